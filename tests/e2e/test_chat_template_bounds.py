"""Chat templates are untrusted code with a budget: `data prepare --format chat` refuses a template that loops,
recurses or builds huge strings in one line naming the file and the record, writes no manifest, and finds
the assistant's tokens of a long conversation with a constant number of renders (not one per prefix)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chat_fixtures import TEMPLATES, tokenizer_dir
from moetrain import cli
from moetrain.data.chat import ChatTemplate, ConversationError, encode_conversation

CHATML = TEMPLATES["qwen_chatml"]
HOSTILE = {  # template prefix -> what the one-line refusal says
    "loop": ("{% for i in range(100000) %}{% for j in range(100000) %}{% for k in range(100000) %}"
             "{% endfor %}{% endfor %}{% endfor %}", "ran longer than its 0.5 s limit"),
    "recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "nests calls deeper than"),
    "huge string": ("{{ 'x' * 10000000000 }}", "over its limit of"),
    "doubling": ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
                 "{% endfor %}", "over its limit of"),
}


@pytest.fixture(scope="module")
def directory(tmp_path_factory) -> Path:
    return tokenizer_dir(tmp_path_factory.mktemp("bounds") / "tok", CHATML)


def _conversations(path: Path, conversations: list) -> Path:
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return path


def _prepare(directory: Path, source: Path, out: Path, *extra: str) -> int:
    return cli.main(["data", "prepare", "--input", str(source), "--out", str(out), "--tokenizer", str(directory),
                     "--format", "chat", "--quiet", "--template-time-limit", "0.5", *extra])


@pytest.mark.parametrize("case", HOSTILE)
def test_a_hostile_template_is_one_line_naming_file_and_record(directory, tmp_path, capsys, case):
    prefix, answer = HOSTILE[case]
    template = tmp_path / "bad.jinja"
    template.write_text(prefix + CHATML)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    source = _conversations(tmp_path / "chats.jsonl", [chat, chat])
    assert _prepare(directory, source, tmp_path / "out", "--chat-template", str(template)) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(lines) == 1 and answer in lines[0] and f"{source}:1:" in lines[0] and f"({template})" in lines[0], lines
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_non_utf8_template_file_is_one_line(directory, tmp_path, capsys):
    template = tmp_path / "latin1.jinja"
    template.write_bytes("{# café #}".encode("latin-1") + CHATML.encode())
    source = _conversations(tmp_path / "chats.jsonl", [[{"role": "assistant", "content": "yo"}]])
    assert _prepare(directory, source, tmp_path / "out", "--chat-template", str(template)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"chat template '{template}' is not UTF-8" in err[0], err


def test_a_long_conversation_renders_a_constant_number_of_times(directory, tmp_path, monkeypatch):
    turns = [{"role": r, "content": f"{r} says {i}"} for i in range(1500) for r in ("user", "assistant")]
    # through the command: 3000 messages in well under the 0.5 s budget (a render per prefix takes minutes)
    source = _conversations(tmp_path / "long.jsonl", [turns, turns[:6]])
    assert _prepare(directory, source, tmp_path / "out", "--heldout-fraction", "0") == 0
    renders = []
    original = ChatTemplate.render
    monkeypatch.setattr(ChatTemplate, "render", lambda self, *a, **k: renders.append(1) or original(self, *a, **k))
    template = ChatTemplate(CHATML, {})
    encode = lambda text: ([ord(c) for c in text], [(i, i + 1) for i in range(len(text))])  # noqa: E731
    ids, mask, _ = encode_conversation(template, encode, turns)
    assert len(renders) <= 6  # the whole conversation plainly and tracked, two prefix renders each for 2 turns
    # the spans are the prefix rule's, turn by turn
    for i in range(1, 12, 2):
        prompt, _ = original(template, turns[:i], add_generation_prompt=True)
        turn, _ = original(template, turns[: i + 1])
        assert mask[len(prompt): len(turn.rstrip())].all() and not mask[len(prompt) - 1]
    assert int(mask.sum()) == sum(len(f"{t['content']}<|im_end|>") for t in turns if t["role"] == "assistant")


def test_a_template_that_rewrites_earlier_turns_is_still_refused():
    # drops every assistant turn but the last: a prefix's rendering is not the whole conversation's start
    rewriting = ("{% for m in messages %}{% if m.role != 'assistant' or loop.last %}<|im_start|>{{ m.role }}\n"
                 "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}")
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]
    with pytest.raises(ConversationError, match="does not render turn 1 as a prefix"):
        encode_conversation(ChatTemplate(rewriting, {}), lambda t: (list(t), [(i, i + 1) for i in range(len(t))]),
                            chat)


def test_export_writes_the_template_the_run_trained_with_and_nothing_half_written(job_args, tmp_path, capsys,
                                                                                   monkeypatch):
    from moetrain.interop import hf_io

    directory = tokenizer_dir(tmp_path / "qwen3", CHATML)
    chats = [[{"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": f"{i} said"}]
             for i in range(40)]
    shards, run_dir = tmp_path / "shards", tmp_path / "run"
    assert _prepare(directory, _conversations(tmp_path / "chats.jsonl", chats), shards) == 0
    argv = [*job_args(run_dir, train__steps=2, checkpoint__every=2, train__eval_every=0, data__source="tokens",
                      data__path=str(shards), data__seq_len=32, data__heldout_fraction=0.05, model__vocab_size=512),
            "--data.tokenizer", str(directory)]
    assert cli.main(["train", *argv]) == 0
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ 'changed after training' }}"
    (directory / "tokenizer_config.json").write_text(json.dumps(config))

    out = tmp_path / "export"
    monkeypatch.setattr(hf_io, "_write_tokenizer", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left")))
    assert cli.main(["export-hf", "--run", str(run_dir), "--out", str(out)]) == 2
    assert not out.exists() and not list(tmp_path.glob(".export*")), list(tmp_path.iterdir())
    monkeypatch.undo()
    capsys.readouterr()
    assert cli.main(["export-hf", "--run", str(run_dir), "--out", str(out)]) == 0
    assert (out / "chat_template.jinja").read_text() == CHATML
    assert not list(tmp_path.glob(".export*"))


def test_a_template_using_the_messages_as_a_list_is_masked_by_its_prefixes():
    # `messages + [...]` needs a real list: the one-render path steps aside, the prefix rule answers
    template = ChatTemplate("{% for m in messages + [] %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}", {})
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    encode = lambda text: ([ord(c) for c in text], [(i, i + 1) for i in range(len(text))])  # noqa: E731
    _, mask, assistant = encode_conversation(template, encode, chat)
    assert assistant == "b<|im_end|>" and int(mask.sum()) == len("b<|im_end|>")
