"""Tokenizers that travel with a model directory: the byte tokenizer written as tokenizer.json, special ids
from config.json, and exact bytes per token for byte-level BPE vocabularies (bits per byte)."""

from __future__ import annotations

import json

import pytest
import torch

from moetrain.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    build_tokenizer,
    byte_level_alphabet,
    write_byte_level_tokenizer,
)
from moetrain.errors import ConfigError

TEXTS = ["def héllo(x):\n\treturn x  # ✓ 日本語 🙂\r\n", "", "  spaces  and\ttabs\n", "ÿ\x00\x7f€"]


def model_dir(tmp_path, **special):
    write_byte_level_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "config.json").write_text(json.dumps({f"{k}_token_id": v for k, v in special.items()}))
    return tmp_path


def test_byte_tokenizer_written_as_tokenizer_json_is_the_same_tokenizer(tmp_path):
    directory = model_dir(tmp_path, bos=256, eos=257, pad=258)
    tok, byte = build_tokenizer(str(directory)), ByteTokenizer()
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (259, 256, 257, 258)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids.tolist() == byte.encode(text).tolist()
        assert tok.decode([tok.bos_id, *ids.tolist(), tok.eos_id]) == text
    assert torch.equal(tok.token_byte_lengths(), byte.token_byte_lengths())


def test_special_ids_come_from_config_json_and_missing_or_clashing_ones_are_appended(tmp_path):
    # OLMoE-like: no BOS, EOS set, PAD set; Qwen3-base-like: BOS == EOS (packing needs them apart)
    olmoe = HFTokenizer(model_dir(tmp_path, eos=257, pad=3) / "tokenizer.json", {"bos": None, "eos": 257, "pad": 3})
    assert (olmoe.bos_id, olmoe.eos_id, olmoe.pad_id, olmoe.vocab_size) == (259, 257, 3, 260)
    qwen = HFTokenizer(tmp_path / "tokenizer.json", {"bos": 256, "eos": 256, "pad": 256})
    assert (qwen.bos_id, qwen.eos_id, qwen.pad_id, qwen.vocab_size) == (259, 256, 260, 261)
    bare = build_tokenizer(str(tmp_path / "tokenizer.json"))  # a bare file: all three appended, as before
    assert (bare.bos_id, bare.eos_id, bare.pad_id, bare.vocab_size) == (259, 260, 261, 262)


def test_byte_level_bpe_tokens_count_their_bytes_exactly(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["日本語のテキスト 🙂🙂 naïve café"] * 50 + ["def f(x): return x"] * 50
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel
                                                        .alphabet(), special_tokens=["<|endoftext|>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = build_tokenizer(str(tmp_path / "tokenizer.json"))
    lengths = hf.token_byte_lengths()
    assert lengths[tok.token_to_id("<|endoftext|>")] == 0 and lengths[hf.eos_id] == 0
    for text in ["テキスト 🙂 café", "naïve 日本 x", "語🙂"]:
        ids = hf.encode(text)
        # some tokens are pieces of a multi-byte character: decoding one alone cannot count them
        assert int(lengths[ids].sum()) == len(text.encode("utf-8")), text
    assert len(byte_level_alphabet()) == 256 and len(set(byte_level_alphabet().values())) == 256


def test_a_directory_without_tokenizer_json_is_named(tmp_path):
    with pytest.raises(ConfigError, match="directory without tokenizer.json"):
        build_tokenizer(str(tmp_path))
