"""Conversations through prepare -> shards -> batches -> loss, against transformers as the reference.

The reference for every target: transformers' own tokenizer (`apply_chat_template` with
`return_assistant_tokens_mask`, or the hand-derived content + end-of-turn for templates without
markers), labels = ids where the mask is 1 else -100, shifted by one as its causal LM loss does.
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from chat_fixtures import TEMPLATES, tokenizer_dir
from moetrain.config.data import DataConfig
from moetrain.config.job import JobConfig
from moetrain.data.batching import build_batching
from moetrain.data.chat import load_chat_template
from moetrain.data.dataset import load_training_data
from moetrain.data.packing import IGNORE_INDEX
from moetrain.data.prepare.command import PrepareArgs, prepare
from moetrain.data.shards import MANIFEST
from moetrain.errors import ConfigError
from moetrain.train.loss import token_loss_sum


def many_conversations(n: int, seed: int = 0) -> list[list[dict]]:
    """Varied conversations (1 to 3 exchanges, some with a system prompt)."""
    rng = random.Random(seed)
    words = "alpha beta gamma delta sky blue green snow white 日本語 🙂 what why how four".split()
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": "Be brief."}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 3)):
            messages.append({"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(1, 8)))})
            messages.append({"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(1, 12)))})
        out.append(messages)
    return out


def write_jsonl(path: Path, conversations: list, field: str = "messages") -> Path:
    path.write_text("".join(json.dumps({field: c, "id": i}) + "\n" for i, c in enumerate(conversations)))
    return path


def reference_labels(directory: Path, conversation: list[dict]) -> tuple[list[int], list[int]]:
    """(ids, labels) from transformers: labels are the ids on the assistant's tokens, -100 elsewhere."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory))
    template = load_chat_template(str(directory))
    if template.has_generation_markers:
        out = tok.apply_chat_template(copy.deepcopy(conversation), tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    else:  # hand-derived: each assistant turn's content and end-of-turn token (from the rendered prefixes)
        ids = list(tok.apply_chat_template(copy.deepcopy(conversation), tokenize=True, return_dict=True)["input_ids"])
        mask = [0] * len(ids)
        for i, message in enumerate(conversation):
            if message["role"] == "assistant":
                before = tok.apply_chat_template(conversation[:i], tokenize=False, add_generation_prompt=True)
                upto = tok.apply_chat_template(conversation[: i + 1], tokenize=False).rstrip()
                a = len(tok(before, add_special_tokens=False)["input_ids"])
                b = len(tok(upto, add_special_tokens=False)["input_ids"])
                mask[a:b] = [1] * (b - a)
    return ids, [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]


def prepared(tmp_path: Path, style: str, conversations: list, **options) -> tuple[Path, Path]:
    directory = tokenizer_dir(tmp_path / "tok", TEMPLATES[style])
    source = write_jsonl(tmp_path / "chats.jsonl", conversations)
    out = tmp_path / "shards"
    prepare(PrepareArgs(input=[str(source)], out=str(out), tokenizer=str(directory), format="chat", quiet=True,
                        shard_mb=options.pop("shard_mb", 0.002), heldout_fraction=options.pop("heldout", 0.0),
                        **options))
    return directory, out


def job(directory: Path, out: Path, **data) -> JobConfig:
    cfg = JobConfig()
    cfg.data = DataConfig(source="tokens", path=str(out), tokenizer=str(directory), heldout_fraction=0.0, **data)
    cfg.model.vocab_size = 512
    return cfg


@pytest.mark.parametrize("style", ["qwen_chatml", "llama3_generation"])
def test_packed_targets_are_transformers_labels_shifted_within_each_conversation(tmp_path, style):
    conversations = many_conversations(40, seed=1)
    directory, out = prepared(tmp_path, style, conversations)
    manifest = json.loads((out / MANIFEST).read_text())
    assert len(manifest["splits"]["train"]) > 1  # windows cross shard boundaries
    assert manifest["chat"]["template_sha256"] == load_chat_template(str(directory)).sha256
    data = load_training_data(job(directory, out, seq_len=64))
    # The reference stream: conversations in name order (file:line), each one's targets its own next labels.
    want_tokens, want_targets = [], []
    for conversation in conversations:
        ids, labels = reference_labels(directory, conversation)
        want_tokens += ids
        want_targets += labels[1:] + [IGNORE_INDEX]  # the last token predicts nothing (the next conversation)
    n = len(want_tokens)
    assert len(data.train.stream) == n and manifest["chat"]["loss_tokens"]["train"] == sum(
        t != IGNORE_INDEX for t in want_targets)
    seq = data.train.seq_len
    pad_tail = data.train.n_sequences * seq - n
    want_tokens_t = torch.tensor(want_tokens + [data.tokenizer.pad_id] * pad_tail).view(-1, seq)
    want_targets_t = torch.tensor(want_targets + [IGNORE_INDEX] * pad_tail).view(-1, seq)
    batch = data.train.batch(list(range(data.train.n_sequences)))
    assert torch.equal(batch.tokens, want_tokens_t)
    assert torch.equal(batch.targets, want_targets_t)
    # a conversation never attends into another: document ids change exactly at conversation starts
    starts = np.cumsum([0] + [len(reference_labels(directory, c)[0]) for c in conversations[:-1]])
    flat_ids = batch.document_ids.view(-1)
    flat_positions = batch.positions.view(-1)
    for start in starts[1:]:
        if start % seq:
            assert flat_ids[start] == flat_ids[start - 1] + 1 and flat_positions[start] == 0


def test_token_budget_bins_hold_whole_conversations_with_their_masks(tmp_path):
    conversations = many_conversations(30, seed=2)
    directory, out = prepared(tmp_path, "chatml_generation", conversations)
    cfg = job(directory, out, batching="token_budget", token_budget=256)
    data = load_training_data(cfg)
    batching = build_batching(data.train, cfg.data, 1, seed=0)
    references = [reference_labels(directory, c) for c in conversations]
    by_tokens = {tuple(ids): labels for ids, labels in references}
    seen = 0
    for unit in range(batching.n_units):
        batch = batching.microbatch([unit])
        for doc in torch.unique(batch.document_ids[0]).tolist():
            where = batch.document_ids[0] == doc
            ids = tuple(batch.tokens[0][where].tolist())
            labels = by_tokens[ids]  # a whole conversation (each fits the budget), found as it was rendered
            assert batch.targets[0][where].tolist() == labels[1:] + [IGNORE_INDEX]
            assert batch.positions[0][where].tolist() == list(range(len(ids)))
            seen += 1
    assert seen == len(conversations)


def test_sft_loss_of_an_imported_model_equals_transformers_with_labels_minus_100(tmp_path):
    import hf_tiny

    conversations = many_conversations(12, seed=3)
    directory = tokenizer_dir(tmp_path / "model", TEMPLATES["qwen_chatml"])
    special = json.loads((directory / "config.json").read_text())
    reference = hf_tiny.build("qwen3_moe", vocab_size=512, **special)
    reference.save_pretrained(directory)
    source = write_jsonl(tmp_path / "chats.jsonl", conversations)
    out = tmp_path / "shards"
    prepare(PrepareArgs(input=[str(source)], out=str(out), tokenizer=str(directory), format="chat", quiet=True,
                        heldout_fraction=0.0))
    from moetrain.train.build import load_hf_model

    model, cfg = load_hf_model(directory)
    cfg.data = DataConfig(source="tokens", path=str(out), tokenizer=str(directory), heldout_fraction=0.0,
                          batching="token_budget", token_budget=400)
    data = load_training_data(cfg)
    batching = build_batching(data.train, cfg.data, 1, seed=0)
    loss_sum, n_valid = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for unit in range(batching.n_units):  # the step objective: every microbatch's sum / the global count
            batch = batching.microbatch([unit])
            logits = model(batch.tokens, positions=batch.positions, document_ids=batch.document_ids)
            part, count = token_loss_sum(logits, batch.targets)
            loss_sum += part.double()
            n_valid += count
        got = loss_sum / n_valid
        want_sum, want_n = torch.zeros((), dtype=torch.float64), 0
        for conversation in conversations:  # transformers: one conversation at a time, labels = -100 masked
            ids, labels = reference_labels(directory, conversation)
            result = reference(torch.tensor([ids]), labels=torch.tensor([labels]))
            count = sum(label != IGNORE_INDEX for label in labels[1:])
            want_sum += result.loss.double() * count
            want_n += count
        want = want_sum / want_n
    assert n_valid == want_n
    relative = abs(float(got) - float(want)) / float(want)
    print(f"SFT loss {float(got):.8f} vs transformers {float(want):.8f}: relative {relative:.2e}")
    assert abs(float(got) - float(want)) / float(want) <= 1e-5, (float(got), float(want))


def test_bad_conversations_are_refused_naming_file_and_line_or_skipped_and_counted(tmp_path):
    directory = tokenizer_dir(tmp_path / "tok", TEMPLATES["qwen_chatml"])
    good = many_conversations(6, seed=4)
    bad_lines = {
        "no assistant turn": json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
        "role 'wizard'": json.dumps({"messages": [{"role": "wizard", "content": "hi"},
                                                  {"role": "assistant", "content": "x"}]}),
        "no --messages-field 'messages'": json.dumps({"conversation": good[0]}),
        "not a JSON object": "{not json",
    }
    for i, (needle, line) in enumerate(bad_lines.items()):
        lines = [json.dumps({"messages": c}) for c in good]
        lines.insert(3, line)
        source = tmp_path / f"bad{i}.jsonl"
        source.write_text("\n".join(lines) + "\n")
        out = tmp_path / f"out{i}"
        with pytest.raises(ConfigError, match=needle) as info:
            prepare(PrepareArgs(input=[str(source)], out=str(out), tokenizer=str(directory), format="chat",
                                quiet=True, heldout_fraction=0.0))
        assert f"{source}:4:" in str(info.value) and "\n" not in str(info.value)
        assert not (out / MANIFEST).exists()  # nothing a run could train on
        manifest = prepare(PrepareArgs(input=[str(source)], out=str(tmp_path / f"skip{i}"), tokenizer=str(directory),
                                       format="chat", quiet=True, heldout_fraction=0.0, skip_bad_files=True))
        assert manifest["chat"]["skipped_documents"] == 1 and manifest["train_documents"] == len(good)
    raising = tokenizer_dir(tmp_path / "raising", "{% if messages|length > 3 %}{{ raise_exception('too long') }}"
                                                  "{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}")
    short = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    source = write_jsonl(tmp_path / "long.jsonl", [short, [{"role": "user", "content": "a"}] * 3 + short[1:]])
    with pytest.raises(ConfigError, match=r"long.jsonl:2: .*the chat template raised: too long"):
        prepare(PrepareArgs(input=[str(source)], out=str(tmp_path / "r"), tokenizer=str(raising), format="chat",
                            quiet=True, heldout_fraction=0.0))


def test_a_run_with_another_template_or_tokenizer_is_refused_in_one_line(tmp_path):
    directory, out = prepared(tmp_path, "qwen_chatml", many_conversations(5))
    other = tokenizer_dir(tmp_path / "other", TEMPLATES["chatml_generation"])
    with pytest.raises(ConfigError, match="chat template sha256") as info:
        load_training_data(job(other, out))
    assert "\n" not in str(info.value)
    override = tmp_path / "template.jinja"
    override.write_text(TEMPLATES["llama3"])
    with pytest.raises(ConfigError, match="chat template sha256"):
        load_training_data(job(directory, out, chat_template=str(override)))
    retrained = tokenizer_dir(tmp_path / "retrained", TEMPLATES["qwen_chatml"], vocab_size=300)
    with pytest.raises(ConfigError, match="was prepared with tokenizer"):
        load_training_data(job(retrained, out))
    load_training_data(job(directory, out))  # the same directory trains


@pytest.mark.parametrize("suffix", [".parquet", ".json"])
def test_parquet_and_json_inputs_prepare_like_jsonl(tmp_path, suffix):
    datasets = pytest.importorskip("datasets")
    conversations = many_conversations(10, seed=5)
    directory, jsonl_out = prepared(tmp_path, "llama3", conversations)
    table = datasets.Dataset.from_list([{"messages": c} for c in conversations])
    source = tmp_path / f"chats{suffix}"
    if suffix == ".parquet":
        table.to_parquet(str(source))
    else:
        source.write_text(json.dumps([{"messages": c} for c in conversations]))
    out = tmp_path / f"from{suffix}"
    prepare(PrepareArgs(input=[str(source)], out=str(out), tokenizer=str(directory), format="chat", quiet=True,
                        heldout_fraction=0.0))
    a = load_training_data(job(directory, jsonl_out, seq_len=32)).train
    b = load_training_data(job(directory, out, seq_len=32)).train
    assert a.n_sequences == b.n_sequences
    every = list(range(a.n_sequences))
    assert all(torch.equal(x, y) for x, y in zip(vars(a.batch(every)).values(), vars(b.batch(every)).values()))


@pytest.mark.parametrize("style,end", [("qwen_chatml", "<|im_end|>"), ("llama3", "<|eot_id|>")])
def test_export_writes_the_chat_template_and_a_generation_config_that_stops_at_the_end_of_turn(tmp_path, style,
                                                                                               end):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    import hf_tiny
    from moetrain.interop.hf_io import save_hf
    from moetrain.train.build import load_hf_model

    directory = tokenizer_dir(tmp_path / "model", TEMPLATES[style])
    special = json.loads((directory / "config.json").read_text())
    hf_tiny.build("qwen3_moe", vocab_size=512, **special).save_pretrained(directory)
    if style == "qwen_chatml":  # no tokenizer_config.json (the template uses no special-token variable):
        (directory / "tokenizer_config.json").unlink()  # export writes the config transformers needs
    override = tmp_path / "template.jinja"
    override.write_text(TEMPLATES[style])
    model, cfg = load_hf_model(directory)
    cfg.data.chat_template = str(override)
    out = save_hf(model, cfg, tmp_path / "export")
    tok = AutoTokenizer.from_pretrained(str(out))
    conversation = [{"role": "user", "content": "What is 2 + 2?"}]
    prompt = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert prompt == load_chat_template(str(directory), str(override)).render(conversation, True)[0]
    generation = GenerationConfig.from_pretrained(str(out))
    eos = generation.eos_token_id if isinstance(generation.eos_token_id, list) else [generation.eos_token_id]
    assert tok.convert_tokens_to_ids(end) in eos
    exported = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids = tok.apply_chat_template(conversation, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    generated = exported.generate(**ids, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] > ids["input_ids"].shape[1]


def test_start_up_checks_sizes_and_a_damaged_file_is_refused_at_its_first_read_or_by_data_verify(tmp_path):
    from moetrain.data.prepare.command import main as data_main

    directory, out = prepared(tmp_path, "qwen_chatml", many_conversations(40, seed=6))
    assert data_main(["verify", str(out)]) == 0  # intact: every file's sha256 matches
    tokens = out / "train" / "shard_00001.tokens.npy"
    data = bytearray(tokens.read_bytes())
    data[-1] ^= 0x01  # same size, one token changed: only the sha256 sees it
    tokens.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="shard_00001.tokens.npy fails its sha256 check") as info:
        data_main(["verify", str(out)])
    assert "\n" not in str(info.value)
    train = load_training_data(job(directory, out, seq_len=16)).train  # start-up: sizes and headers only
    first = train.stream.starts[1]  # shard 1 starts here: sequences before it read shard 0 only
    train.batch([0])
    with pytest.raises(ConfigError, match="shard_00001.tokens.npy fails its sha256 check"):
        train.batch([int(first) // 16 + 1])
    mask = out / "train" / "shard_00000.mask.npy"
    data = bytearray(mask.read_bytes())
    data[-1] ^= 0x01
    mask.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match="shard_00000.mask.npy fails its sha256 check"):
        load_training_data(job(directory, out, seq_len=16)).train.batch([0])
