"""`data prepare --tokenizer DIR` tokenizes as transformers' AutoTokenizer loads DIR, id for id, on every family.

Each family's tiny directory carries the byte-level tokenizer.json (tests/hf_tiny.py) and, as released
models often do, declares its chat tokens only in tokenizer_config.json: some in `added_tokens_decoder`,
one as `additional_special_tokens`, BOS/EOS by name; config.json gives BOS/EOS ids. Text documents and
conversations prepared through the command must hold exactly the ids AutoTokenizer gives them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import hf_tiny
from chat_fixtures import CONVERSATIONS
from moetrain import cli

# family -> (tokens declared in added_tokens_decoder, one declared only as additional_special_tokens,
#            BOS, EOS, a chat template in the family's style written with those tokens)
FAMILY_TOKENS = {
    "qwen3_moe": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<tool_call>", "<|endoftext|>", "<|im_end|>",
                  "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "olmoe": (["<|endoftext|>", "<|padding|>", "<|user|>", "<|assistant|>", "<|end|>"], "<|system|>",
              "<|endoftext|>", "<|end|>", "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}"
              "{% if m.role == 'assistant' %}{{ eos_token }}{% endif %}\n{% endfor %}"
              "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"),
    "mixtral": (["<s>", "</s>", "[INST]", "[/INST]"], "[TOOL_CALLS]", "<s>", "</s>",
                "{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}{{ m.content }}{{ eos_token }}"
                "{% else %}[INST] {{ m.content }} [/INST]{% endif %}{% endfor %}"),
    "qwen2_moe": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|tool|>", "<|endoftext|>", "<|im_end|>",
                  "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "gpt_oss": (["<|startoftext|>", "<|start|>", "<|message|>", "<|end|>", "<|return|>"], "<|channel|>",
                "<|startoftext|>", "<|return|>",
                "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
                "{% if add_generation_prompt %}<|start|>assistant<|message|>{% endif %}"),
    "deepseek_v3": (["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"],
                    "<｜tool▁calls▁begin｜>", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                    "{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}<｜Assistant｜>{{ m.content }}"
                    "{{ eos_token }}{% else %}<｜User｜>{{ m.content }}{% endif %}{% endfor %}"
                    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"),
    "glm4_moe": (["<|endoftext|>", "[gMASK]", "<sop>", "<|user|>", "<|assistant|>"], "<|observation|>",
                 "[gMASK]", "<|endoftext|>",
                 "[gMASK]<sop>{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"),
}
assert set(FAMILY_TOKENS) == set(hf_tiny.FAMILIES)


def family_directory(family: str, root: Path) -> Path:
    declared, extra, bos, eos, template = FAMILY_TOKENS[family]
    directory = root / family
    directory.mkdir(parents=True)
    hf_tiny.write_byte_level_tokenizer(directory / "tokenizer.json")  # 256 bytes + <|bos|> <|eos|> <|pad|>
    decoder = {str(259 + i): {"content": t, "special": True, "lstrip": False, "rstrip": False, "normalized": False,
                              "single_word": False} for i, t in enumerate(declared)}
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": decoder, "bos_token": bos,
        "eos_token": eos, "additional_special_tokens": [extra], "chat_template": template}))
    ids = {t: 259 + i for i, t in enumerate(declared)}
    config = hf_tiny.config(family).to_dict()
    config.update(bos_token_id=ids[bos], eos_token_id=ids[eos], pad_token_id=258)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def prepared_documents(out: Path) -> list[list[int]]:
    documents = []
    for tokens_file in sorted((out / "train").glob("*.tokens.npy")):
        tokens = np.load(tokens_file).tolist()
        offsets = np.load(str(tokens_file).replace(".tokens.", ".offsets.")).tolist()
        documents += [tokens[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
    return documents


@pytest.mark.parametrize("family", hf_tiny.FAMILIES)
def test_prepared_ids_are_autotokenizers_on_text_and_conversations(family, tmp_path):
    from transformers import AutoTokenizer

    directory = family_directory(family, tmp_path)
    declared, extra, bos, eos, _ = FAMILY_TOKENS[family]
    reference = AutoTokenizer.from_pretrained(str(directory))
    texts = [f"{declared[1]}user\nhéllo {extra} 日本語{declared[-1]}", f"{bos}x{eos} y {declared[2]}{declared[2]}z"]
    (tmp_path / "text.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    common = ["--tokenizer", str(directory), "--heldout-fraction", "0", "--quiet"]
    assert cli.main(["data", "prepare", "--input", str(tmp_path / "text.jsonl"), "--out", str(tmp_path / "t"),
                     *common]) == 0
    assert cli.main(["data", "prepare", "--input", str(tmp_path / "chat.jsonl"), "--out", str(tmp_path / "c"),
                     "--format", "chat", *common]) == 0
    bos_id, eos_id = reference.convert_tokens_to_ids([bos, eos])
    want = sorted([bos_id, *reference(t, add_special_tokens=False)["input_ids"], eos_id] for t in texts)
    assert sorted(prepared_documents(tmp_path / "t")) == want
    want = sorted(list(reference.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"])
                  for c in CONVERSATIONS)
    assert sorted(prepared_documents(tmp_path / "c")) == want
