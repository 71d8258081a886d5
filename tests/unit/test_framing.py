"""data.framing: BOS/EOS as the tokenizer directory says, the default [BOS] text [EOS] unchanged."""

from __future__ import annotations

import json

import pytest
import torch

from chat_fixtures import tokenizer_dir
from moetrain.config.data import DataConfig
from moetrain.config.job import JobConfig
from moetrain.data.dataset import load_training_data
from moetrain.data.prepare.command import PrepareArgs, prepare
from moetrain.data.tokenizer import build_tokenizer, frames_with_bos
from moetrain.errors import ConfigError

TEXTS = ["alpha beta gamma", "sky blue green", "what why how four", "snow white"]


def _job(directory, source, path, framing) -> JobConfig:
    cfg = JobConfig()
    cfg.data = DataConfig(source=source, path=str(path), tokenizer=str(directory), framing=framing,
                          heldout_fraction=0.0, seq_len=8)
    cfg.model.vocab_size = 512
    return cfg


@pytest.mark.parametrize("add_bos", [False, True, None])
def test_tokenizer_framing_follows_add_bos_token_and_shards_equal_the_in_memory_stream(tmp_path, add_bos):
    directory = tokenizer_dir(tmp_path / "tok", None)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    if add_bos is not None:
        config["add_bos_token"] = add_bos
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = build_tokenizer(str(directory))
    # no add_bos_token: the tokenizer's post-processor decides, and this one (like Qwen's) adds nothing
    assert frames_with_bos(str(directory), tokenizer, "tokenizer") is bool(add_bos)
    assert frames_with_bos(str(directory), tokenizer, "bos_eos") is True
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    out = tmp_path / "shards"
    prepare(PrepareArgs(input=[str(source)], out=str(out), tokenizer=str(directory), framing="tokenizer",
                        heldout_fraction=0.0, quiet=True))
    stream = torch.from_numpy(load_training_data(_job(directory, "tokens", out, "tokenizer")).train.stream.read(
        0, 10_000)).long()
    in_memory = load_training_data(_job(directory, "jsonl", source, "tokenizer")).train.stream
    assert torch.equal(stream[: len(in_memory)], torch.from_numpy(in_memory.read(0, len(in_memory))).long())
    want = []
    for text in TEXTS:  # independent: the tokenizer's ids, BOS only when the directory adds one, EOS always
        want += ([tokenizer.bos_id] if add_bos else []) + tokenizer.encode(text).tolist() + [tokenizer.eos_id]
    assert stream[: len(want)].tolist() == want
    with pytest.raises(ConfigError, match="data.framing = 'bos_eos' differs"):
        load_training_data(_job(directory, "tokens", out, "bos_eos"))


def test_text_rows_of_a_parquet_file_prepare_like_the_same_rows_as_a_saved_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_dict({"text": TEXTS * 3})
    table.to_parquet(str(tmp_path / "docs.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    streams = []
    for name in ("docs.parquet", "saved"):
        manifest = prepare(PrepareArgs(input=[str(tmp_path / name)], out=str(tmp_path / f"out_{name}"), quiet=True,
                                       heldout_fraction=0.0))
        assert manifest["train_documents"] == len(TEXTS) * 3
        cfg = JobConfig()
        cfg.data = DataConfig(source="tokens", path=str(tmp_path / f"out_{name}"), heldout_fraction=0.0, seq_len=8)
        train = load_training_data(cfg).train
        streams.append(train.stream.read(0, len(train.stream)))
    assert streams[0].tolist() == streams[1].tolist()
    want = [t for text in TEXTS * 3 for t in [256, *text.encode(), 257]]  # byte tokenizer: [BOS] bytes [EOS]
    assert streams[0].tolist() == want
