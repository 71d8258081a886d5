"""Token shards: prepare -> memory-mapped read against tokenizing directly, rerun safety, every bad-data case."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from moetrain.config.data import DataConfig
from moetrain.config.job import JobConfig
from moetrain.data.corpus import load_corpus
from moetrain.data.dataset import load_training_data
from moetrain.data.packing import PackedSequences, TokenStream, encode_documents
from moetrain.data.prepare import workers
from moetrain.data.prepare.command import PrepareArgs, prepare
from moetrain.data.shards import MANIFEST, open_token_shards, token_dtype
from moetrain.data.tokenizer import build_tokenizer
from moetrain.errors import ConfigError

TEXTS = {
    "a/alpha.txt": "alpha beta gamma\n" * 30,
    "a/beta.txt": "caf\u00e9 \u00fcber na\u00efve \u2014 \U0001f600 " * 12,
    "b/gamma.txt": "def f(x):\n    return x * 2\n" * 25,
    "b/delta.txt": "",  # empty: dropped on both paths
    "c/epsilon.txt": "the quick brown fox jumps over the lazy dog. " * 20,
    "c/zeta.txt": "z" * 700,
    "d/eta.txt": "lorem ipsum dolor sit amet " * 40,
    "d/theta.txt": "0123456789 " * 50,
}


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("texts")
    for name, text in TEXTS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    return root


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory) -> Path:
    """A tiny byte-level BPE trained here on the test texts (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(list(TEXTS.values()), trainer=trainer)
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    tok.save(str(path))
    return path


def _prepare(text_dir: Path, out: Path, tokenizer: str = "byte", **options) -> dict:
    # shard_mb tiny: several shards per split, so windows and documents cross shard boundaries.
    args = {"shard_mb": 0.0008, "heldout_fraction": 0.25, "quiet": True, **options}
    return prepare(PrepareArgs(input=[str(text_dir)], out=str(out), tokenizer=tokenizer, **args))


def _direct(text_dir: Path, tokenizer_spec: str) -> tuple[dict[str, torch.Tensor], dict[str, np.ndarray]]:
    """Each split's stream and document starts by the in-memory path: read, split, tokenize document by document."""
    corpus = load_corpus(DataConfig(source="dir", path=str(text_dir), heldout_fraction=0.25))
    tokenizer = build_tokenizer(tokenizer_spec)
    streams, starts = {}, {}
    for split, docs in (("train", corpus.train), ("heldout", corpus.heldout)):
        streams[split] = encode_documents(docs, tokenizer).long()
        lengths = [tokenizer.encode(d.text).numel() + 2 for d in docs]
        starts[split] = np.cumsum([0] + lengths[:-1])
    return streams, starts


@pytest.mark.parametrize("tokenizer_kind", ["byte", "bpe"])
def test_prepare_then_read_gives_the_directly_tokenized_streams(text_dir, bpe_file, tmp_path, tokenizer_kind):
    spec = "byte" if tokenizer_kind == "byte" else str(bpe_file)
    manifest = _prepare(text_dir, tmp_path / "shards", spec, workers=2)
    assert len(manifest["splits"]["train"]) >= 3, "the test wants windows that cross shard boundaries"
    assert manifest["dtype"] == "uint16"
    streams, starts = _direct(text_dir, spec)
    tokenizer = build_tokenizer(spec)
    shards = open_token_shards(tmp_path / "shards", spec, tokenizer)
    cfg = JobConfig()
    cfg.data = DataConfig(source="tokens", path=str(tmp_path / "shards"), tokenizer=spec, seq_len=16,
                          heldout_fraction=0.25)
    cfg.model.vocab_size = tokenizer.vocab_size
    data = load_training_data(cfg)
    for split, packed in (("train", data.train), ("heldout", data.heldout)):
        on_disk = np.concatenate([s.tokens for s in shards.shards[split]])
        assert torch.equal(torch.from_numpy(on_disk.astype(np.int64)), streams[split]), split
        np.testing.assert_array_equal(packed.document_starts, starts[split])
        reference = PackedSequences(streams[split], 16, tokenizer.eos_id, tokenizer.pad_id)
        assert len(packed) == len(reference)
        every = list(range(len(reference)))
        got, want = packed.batch(every), reference.batch(every)
        for field in ("tokens", "positions", "document_ids", "targets"):
            assert torch.equal(getattr(got, field), getattr(want, field)), (split, field)
    assert data.n_train_documents == len(starts["train"]) and data.n_heldout_documents == len(starts["heldout"])


def test_one_process_preparing_with_two_tokenizers_uses_each(text_dir, bpe_file, tmp_path):
    for spec, out in (("byte", tmp_path / "byte"), (str(bpe_file), tmp_path / "bpe")):
        _prepare(text_dir, out, spec, workers=1)  # in this process: nothing cached may leak between the two
        streams, _ = _direct(text_dir, spec)
        shards = open_token_shards(out, spec, build_tokenizer(spec))
        on_disk = np.concatenate([s.tokens for s in shards.shards["train"]]).astype(np.int64)
        assert torch.equal(torch.from_numpy(on_disk), streams["train"]), spec


def test_jsonl_input_is_named_and_split_as_the_jsonl_source(tmp_path):
    path = tmp_path / "docs.jsonl"
    lines = [json.dumps({"text": f"document number {i} " * (i + 1)}) for i in range(40)]
    path.write_text("\n".join(lines[:10]) + "\n\n" + "\n".join(lines[10:]) + "\n")
    prepare(PrepareArgs(input=[str(path)], out=str(tmp_path / "out"), heldout_fraction=0.2, quiet=True))
    corpus = load_corpus(DataConfig(source="jsonl", path=str(path), heldout_fraction=0.2))
    shards = open_token_shards(tmp_path / "out", "byte", build_tokenizer("byte"))
    for split, docs in (("train", corpus.train), ("heldout", corpus.heldout)):
        on_disk = np.concatenate([s.tokens for s in shards.shards[split]]).astype(np.int64)
        assert torch.equal(torch.from_numpy(on_disk), encode_documents(docs, build_tokenizer("byte")).long())


def test_saved_dataset_input_is_named_and_split_as_the_hf_source(tmp_path):
    datasets = pytest.importorskip("datasets")
    texts = [f"row {i}: " + "text " * (i % 7 + 1) for i in range(30)] + [""]
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "saved"))
    prepare(PrepareArgs(input=[str(tmp_path / "saved")], out=str(tmp_path / "out"), heldout_fraction=0.2,
                        workers=2, shard_mb=0.0002, quiet=True))
    corpus = load_corpus(DataConfig(source="hf", path=str(tmp_path / "saved"), heldout_fraction=0.2))
    shards = open_token_shards(tmp_path / "out", "byte", build_tokenizer("byte"))
    for split, docs in (("train", corpus.train), ("heldout", corpus.heldout)):
        on_disk = np.concatenate([s.tokens for s in shards.shards[split]]).astype(np.int64)
        assert torch.equal(torch.from_numpy(on_disk), encode_documents(docs, build_tokenizer("byte")).long())


def test_token_stream_reads_across_pieces_and_pads_past_the_end():
    rng = np.random.default_rng(0)
    pieces = [rng.integers(0, 50, size=n).astype(np.uint16) for n in (5, 0, 1, 7, 3)]
    whole = np.concatenate(pieces).astype(np.int64)
    stream = TokenStream(pieces, pad_id=99)
    assert len(stream) == whole.size
    for start in range(whole.size + 2):
        for stop in range(start, whole.size + 4):
            want = np.concatenate([whole[start:stop], np.full(max(0, stop - max(start, whole.size)), 99)])
            np.testing.assert_array_equal(stream.read(start, stop), want)


def test_in_memory_document_starts_are_the_bos_offsets():
    tokenizer = build_tokenizer("byte")
    corpus = load_corpus(DataConfig(source="stdlib", max_documents=20, heldout_fraction=0))
    stream = encode_documents(corpus.train, tokenizer)
    packed = PackedSequences(stream, 64, tokenizer.eos_id, tokenizer.pad_id)
    want = np.cumsum([0] + [len(d.text.encode("utf-8")) + 2 for d in corpus.train[:-1]])
    np.testing.assert_array_equal(packed.document_starts, want)
    assert (stream[torch.from_numpy(want)] == tokenizer.bos_id).all()


def test_token_dtype_follows_the_vocabulary():
    assert token_dtype(259) == np.uint16 and token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32


def _files(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_ino, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def test_interrupted_prepare_continues_and_never_rewrites_a_finished_shard(text_dir, tmp_path, monkeypatch):
    out = tmp_path / "out"
    real = workers.prepare_shard
    calls = []

    def interrupted_after_two(job):
        if len(calls) == 2:
            raise KeyboardInterrupt
        calls.append(job[1:3])
        return real(job)

    monkeypatch.setattr(workers, "prepare_shard", interrupted_after_two)
    with pytest.raises(KeyboardInterrupt):
        _prepare(text_dir, out)
    assert not (out / MANIFEST).exists(), "an interrupted prepare must not look complete"
    finished = _files(out)
    assert sum(name.endswith(".json") for name in finished) == 2
    (out / "train" / ".shard_00009.tokens.npy.tmp-123").write_bytes(b"partial")  # a write cut short

    monkeypatch.setattr(workers, "prepare_shard", real)
    manifest = _prepare(text_dir, out)
    after = _files(out)
    assert {name: after[name] for name in finished} == finished, "finished shards were rewritten"
    assert not list(out.rglob("*.tmp-*")), "the partial file of the interrupted run was left behind"
    fresh = tmp_path / "fresh"
    assert manifest["splits"] == _prepare(text_dir, fresh)["splits"]
    open_token_shards(out, "byte", build_tokenizer("byte"))

    before_rerun = _files(out)
    _prepare(text_dir, out)  # everything finished: nothing but the manifest is written again
    assert {k: v for k, v in _files(out).items() if k != MANIFEST} == \
        {k: v for k, v in before_rerun.items() if k != MANIFEST}


def test_prepare_refuses_to_mix_shards_of_other_inputs(text_dir, tmp_path):
    out = tmp_path / "out"
    _prepare(text_dir, out)
    with pytest.raises(ConfigError, match=r"shard_00000\.json is a finished shard of other inputs"):
        _prepare(text_dir, out, heldout_fraction=0.5)


@pytest.fixture
def prepared(text_dir, tmp_path) -> Path:
    out = tmp_path / "shards"
    _prepare(text_dir, out)
    return out


def _rewrite_npy(path: Path, array: np.ndarray) -> None:
    with open(path, "wb") as handle:
        np.save(handle, array, allow_pickle=False)


def _break(case: str, root: Path) -> str:
    """Damage the prepared directory as `case` says; return the path the error must name."""
    tokens = root / "train" / "shard_00001.tokens.npy"
    if case == "missing shard":
        tokens.unlink()
    elif case == "checksum mismatch":
        data = bytearray(tokens.read_bytes())
        data[-3] ^= 0x01  # same size, one token changed
        tokens.write_bytes(bytes(data))
    elif case == "truncated file":
        data = tokens.read_bytes()
        tokens.write_bytes(data[:-5])
    elif case == "wrong dtype":
        _rewrite_npy(tokens, np.load(tokens, allow_pickle=False).astype(np.int32))
    elif case == "missing manifest":
        (root / MANIFEST).unlink()
        return str(root / MANIFEST)
    return str(tokens)


BAD_CASES = {
    "missing shard": "is missing",
    "checksum mismatch": "fails its sha256 check",
    "truncated file": "is truncated",
    "wrong dtype": "holds int32 values but the manifest says uint16",
    "missing manifest": "is missing",
}


@pytest.mark.parametrize("case", list(BAD_CASES))
def test_bad_shards_are_one_line_errors_naming_the_file(prepared, case):
    named = _break(case, prepared)
    with pytest.raises(ConfigError) as info:
        open_token_shards(prepared, "byte", build_tokenizer("byte"))
    message = str(info.value)
    assert named in message and BAD_CASES[case] in message and "\n" not in message, message


def test_a_manifest_from_another_tokenizer_is_refused(prepared, bpe_file):
    with pytest.raises(ConfigError) as info:
        open_token_shards(prepared, str(bpe_file), build_tokenizer(str(bpe_file)))
    message = str(info.value)
    assert str(prepared / MANIFEST) in message and "prepared with tokenizer 'byte'" in message, message


def test_a_different_heldout_fraction_is_refused(prepared):
    cfg = JobConfig()
    cfg.data = DataConfig(source="tokens", path=str(prepared), heldout_fraction=0.05)
    with pytest.raises(ConfigError, match=r"data.heldout_fraction = 0.05 differs from .*manifest.json \(0.25\)"):
        load_training_data(cfg)
