"""Chat templates rendered and masked as `transformers` does it (the reference: its apply_chat_template)."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from chat_fixtures import CONVERSATIONS, TEMPLATES, tokenizer_dir
from moetrain.data.chat import ConversationError, encode_conversation, load_chat_template
from moetrain.data.tokenizer import build_tokenizer
from moetrain.errors import ConfigError


def hf_tokenizer(directory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory))


@pytest.mark.parametrize("style", sorted(TEMPLATES))
@pytest.mark.parametrize("jinja_file", [False, True])
def test_rendered_text_and_ids_equal_transformers_apply_chat_template(tmp_path, style, jinja_file):
    directory = tokenizer_dir(tmp_path, TEMPLATES[style], jinja_file=jinja_file)
    reference = hf_tokenizer(directory)
    template = load_chat_template(str(directory))
    tokenizer = build_tokenizer(str(directory))
    for conversation in CONVERSATIONS:
        for prompt in (False, True):
            want = reference.apply_chat_template(copy.deepcopy(conversation), tokenize=False,
                                                 add_generation_prompt=prompt)
            clean = [{k: v for k, v in m.items() if v is not None} for m in conversation]
            assert template.render(clean, add_generation_prompt=prompt)[0] == want
        ids, mask, _ = encode_conversation(template, tokenizer.encode_with_offsets, copy.deepcopy(conversation))
        want_ids = reference.apply_chat_template(copy.deepcopy(conversation), tokenize=True, return_dict=True)
        assert ids.tolist() == list(want_ids["input_ids"])
        assert mask.shape == ids.shape


@pytest.mark.parametrize("style", ["llama3_generation", "chatml_generation"])
def test_mask_equals_transformers_return_assistant_tokens_mask_with_generation_markers(tmp_path, style):
    directory = tokenizer_dir(tmp_path, TEMPLATES[style])
    reference = hf_tokenizer(directory)
    template = load_chat_template(str(directory))
    assert template.has_generation_markers
    tokenizer = build_tokenizer(str(directory))
    for conversation in CONVERSATIONS:
        want = reference.apply_chat_template(copy.deepcopy(conversation), tokenize=True, return_dict=True,
                                             return_assistant_tokens_mask=True)
        ids, mask, _ = encode_conversation(template, tokenizer.encode_with_offsets, copy.deepcopy(conversation))
        assert ids.tolist() == list(want["input_ids"])
        assert mask.tolist() == list(want["assistant_masks"])
        assert mask.sum() > 0


def _decoded_masked_runs(tokenizer, ids, mask):
    """The text of each run of mask-1 tokens."""
    runs, current = [], []
    for token, keep in zip(ids.tolist(), mask.tolist()):
        if keep:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer._tok.decode(run, skip_special_tokens=False) for run in runs]


@pytest.mark.parametrize("style,end", [("qwen_chatml", "<|im_end|>"), ("llama3", "<|eot_id|>")])
def test_mask_without_markers_is_each_assistant_content_and_its_end_of_turn(tmp_path, style, end):
    directory = tokenizer_dir(tmp_path, TEMPLATES[style])
    template = load_chat_template(str(directory))
    assert not template.has_generation_markers
    tokenizer = build_tokenizer(str(directory))
    for conversation in CONVERSATIONS:
        ids, mask, _ = encode_conversation(template, tokenizer.encode_with_offsets, copy.deepcopy(conversation))
        contents = [m["content"] for m in conversation if m["role"] == "assistant"]
        if style == "llama3":  # this template trims the content
            contents = [c.strip() for c in contents]
        # hand-derived: exactly the assistant turns' content followed by the end-of-turn token, nothing else
        assert _decoded_masked_runs(tokenizer, ids, mask) == [c + end for c in contents]


def test_markers_and_prefix_diff_agree_on_the_same_template_family(tmp_path):
    """Llama-3 with and without markers renders the same; the two ways of finding the mask agree."""
    with_markers = tokenizer_dir(tmp_path / "a", TEMPLATES["llama3_generation"])
    without = tokenizer_dir(tmp_path / "b", TEMPLATES["llama3"])
    for conversation in CONVERSATIONS:
        a = encode_conversation(load_chat_template(str(with_markers)),
                                build_tokenizer(str(with_markers)).encode_with_offsets, copy.deepcopy(conversation))
        b = encode_conversation(load_chat_template(str(without)), build_tokenizer(str(without)).encode_with_offsets,
                                copy.deepcopy(conversation))
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def test_bad_conversations_raise_one_line_conversation_errors(tmp_path):
    directory = tokenizer_dir(tmp_path, TEMPLATES["qwen_chatml"])
    template = load_chat_template(str(directory))
    encode = build_tokenizer(str(directory)).encode_with_offsets
    cases = {
        "no assistant turn": [{"role": "user", "content": "hi"}],
        "valid roles": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "x"}],
        "not a non-empty list": "hello",
        "not an object": ["hello"],
    }
    for needle, messages in cases.items():
        with pytest.raises(ConversationError, match=needle) as info:
            encode_conversation(template, encode, messages)
        assert "\n" not in str(info.value)
    raising = load_chat_template(str(tokenizer_dir(
        tmp_path / "r", "{% if messages|length > 2 %}{{ raise_exception('too long: ' ~ messages|length) }}"
                        "{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}")))
    with pytest.raises(ConversationError, match="the chat template raised: too long: 3"):
        encode_conversation(raising, encode, CONVERSATIONS[2][:3])


def test_template_sandbox_and_missing_template_are_refused(tmp_path):
    escaping = load_chat_template(str(tokenizer_dir(
        tmp_path / "s", "{{ ''.__class__.__mro__[1].__subclasses__() }}{% for m in messages %}{{ m.content }}"
                        "{% endfor %}")))
    with pytest.raises(ConversationError, match="SecurityError|raised"):
        escaping.render([{"role": "assistant", "content": "x"}])
    with pytest.raises(ConfigError, match="has no chat template"):
        load_chat_template(str(tokenizer_dir(tmp_path / "n", None)))
    with pytest.raises(ConfigError, match="does not parse"):
        load_chat_template(str(tokenizer_dir(tmp_path / "p", "{% for m in messages %}")))
    with pytest.raises(ConfigError, match="needs a tokenizer directory"):
        load_chat_template("byte")
