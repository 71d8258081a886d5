"""Data pipeline: tokenizer, corpus sources and bad data, packing against a plain-loop reference."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from moetrain.config.data import DataConfig
from moetrain.data.corpus import STDLIB_EXCLUDED_DIRS, Document, is_heldout, load_corpus, stdlib_files
from moetrain.data.packing import IGNORE_INDEX, PackedSequences, encode_documents, pack_documents
from moetrain.data.tokenizer import ByteTokenizer, build_tokenizer
from moetrain.errors import ConfigError

# ---------------------------------------------------------------- tokenizer


def test_byte_tokenizer_round_trips_utf8_and_drops_specials():
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'héllo ∑'"
    ids = tok.encode(text)
    assert ids.tolist() == list(text.encode("utf-8"))
    assert tok.decode([tok.bos_id, *ids.tolist(), tok.eos_id, tok.pad_id]) == text
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (259, 256, 257, 258)
    assert tok.token_byte_lengths().tolist() == [1] * 256 + [0, 0, 0]
    assert tok.encode("").numel() == 0


def test_tokenizer_spec_errors_are_one_line(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="data.tokenizer = 'nope.json' is invalid"):
        build_tokenizer("nope.json")
    spec = tmp_path / "tok.json"
    spec.write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if the optional extra were not installed
    with pytest.raises(ConfigError, match=r"needs the `tokenizers` package") as err:
        build_tokenizer(str(spec))
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------- corpus


def _write(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def test_stdlib_corpus_is_sorted_excludes_tests_and_splits_by_name_hash():
    root, files = stdlib_files()
    names = [f.relative_to(root).as_posix() for f in files]
    assert names == sorted(names) and len(names) > 100
    assert not any(set(n.split("/")[:-1]) & STDLIB_EXCLUDED_DIRS for n in names)
    corpus = load_corpus(DataConfig(max_documents=60, heldout_fraction=0.25))
    all_names = [d.name for d in corpus.train + corpus.heldout]
    assert sorted(all_names) == names[:60]
    assert {d.name for d in corpus.heldout} == {n for n in names[:60] if is_heldout(n, 0.25)}


def test_heldout_split_is_stable_when_documents_change():
    names = [f"doc{i}.txt" for i in range(400)]
    side = {n: is_heldout(n, 0.1) for n in names}
    assert 15 < sum(side.values()) < 70  # close to 10% of 400
    # The choice depends on the name only: removing other documents never moves one.
    assert all(is_heldout(n, 0.1) == side[n] for n in names[::7])


def test_directory_source_reads_matching_files_in_name_order(tmp_path):
    _write(tmp_path, {"b.txt": b"bee", "a/z.txt": b"zed", "a/y.md": b"skip", "empty.txt": b""})
    corpus = load_corpus(DataConfig(source="dir", path=str(tmp_path), glob="**/*.txt", heldout_fraction=0.0))
    assert [(d.name, d.text) for d in corpus.train] == [("a/z.txt", "zed"), ("b.txt", "bee")]
    assert corpus.heldout == []


def test_empty_directory_is_one_line_config_error(tmp_path):
    with pytest.raises(ConfigError, match="has no files matching") as err:
        load_corpus(DataConfig(source="dir", path=str(tmp_path)))
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="is not a directory"):
        load_corpus(DataConfig(source="dir", path=str(tmp_path / "missing")))


def test_non_utf8_file_errors_or_is_skipped_with_a_warning(tmp_path):
    _write(tmp_path, {"good.txt": b"fine text", "bad.txt": b"caf\xe9 latin-1"})
    with pytest.raises(ConfigError, match=r"'bad.txt' is not UTF-8 text \(bad byte at offset 3\)") as err:
        load_corpus(DataConfig(source="dir", path=str(tmp_path)))
    assert "\n" not in str(err.value)
    corpus = load_corpus(DataConfig(source="dir", path=str(tmp_path), skip_bad_files=True, heldout_fraction=0))
    assert [d.name for d in corpus.train] == ["good.txt"]


def test_unreadable_file_errors_or_is_skipped(tmp_path, monkeypatch):
    _write(tmp_path, {"good.txt": b"fine", "locked.txt": b"secret"})
    real_read_bytes = Path.read_bytes

    def read_bytes(self: Path) -> bytes:
        # Permission bits do not stop root, so simulate the failure at the read itself.
        if self.name == "locked.txt":
            raise PermissionError(13, "Permission denied")
        return real_read_bytes(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    with pytest.raises(ConfigError, match=r"'locked.txt' is unreadable \(Permission denied\)"):
        load_corpus(DataConfig(source="dir", path=str(tmp_path)))
    corpus = load_corpus(DataConfig(source="dir", path=str(tmp_path), skip_bad_files=True, heldout_fraction=0))
    assert [d.name for d in corpus.train] == ["good.txt"]


def test_non_utf8_file_name_errors_or_is_skipped_with_a_warning(tmp_path, caplog):
    (tmp_path / "good.txt").write_text("fine text")
    (Path(os.fsdecode(bytes(tmp_path))) / os.fsdecode(b"caf\xe9.txt")).write_text("named in latin-1")
    with pytest.raises(ConfigError, match=r"^data file name 'caf\\xe9.txt' is not valid UTF-8; rename it") as err:
        load_corpus(DataConfig(source="dir", path=str(tmp_path)))
    assert "\n" not in str(err.value)
    corpus = load_corpus(DataConfig(source="dir", path=str(tmp_path), skip_bad_files=True, heldout_fraction=0))
    assert [d.name for d in corpus.train] == ["good.txt"]
    assert "skipping data file name 'caf\\xe9.txt' is not valid UTF-8" in caplog.text


def test_symlink_loops_are_skipped_with_a_warning(tmp_path, caplog):
    (tmp_path / "good.txt").write_text("fine text")
    (tmp_path / "self").symlink_to("self")
    (tmp_path / "ping").symlink_to("pong")
    (tmp_path / "pong").symlink_to("ping")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "up").symlink_to("..")  # a directory cycle: globbing must not descend forever
    corpus = load_corpus(DataConfig(source="dir", path=str(tmp_path), glob="**/*", heldout_fraction=0))
    assert [d.name for d in corpus.train] == ["good.txt"]
    warned = sorted(r.getMessage() for r in caplog.records if "symbolic link loop" in r.getMessage())
    assert warned == [f"skipping data file '{name}': it is a symbolic link loop" for name in ("ping", "pong", "self")]


def test_all_empty_documents_is_an_error(tmp_path):
    _write(tmp_path, {"a.txt": b"", "b.txt": b""})
    with pytest.raises(ConfigError, match="has no non-empty documents"):
        load_corpus(DataConfig(source="dir", path=str(tmp_path)))


def test_jsonl_source_and_bad_lines(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(["one", "two", "three"])))
    corpus = load_corpus(DataConfig(source="jsonl", path=str(path), heldout_fraction=0))
    assert [d.text for d in corpus.train] == ["one", "two", "three"]
    path.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "no text"}) + "\n{broken\n")
    with pytest.raises(ConfigError, match=r"docs.jsonl:2 is not a JSON object with a string field"):
        load_corpus(DataConfig(source="jsonl", path=str(path)))
    corpus = load_corpus(DataConfig(source="jsonl", path=str(path), skip_bad_files=True, heldout_fraction=0))
    assert [d.text for d in corpus.train] == ["ok"]


def test_hf_source_without_datasets_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ConfigError, match=r"needs the `datasets` package"):
        load_corpus(DataConfig(source="hf", path=str(tmp_path)))


def test_tiny_corpus_still_holds_out_a_document(tmp_path):
    _write(tmp_path, {"a.txt": b"alpha", "b.txt": b"beta"})
    names = [n for n in ("a.txt", "b.txt") if is_heldout(n, 0.01)]
    assert names == []  # neither hashes below 1%, so the fallback is what is tested
    corpus = load_corpus(DataConfig(source="dir", path=str(tmp_path), heldout_fraction=0.01))
    assert [d.name for d in corpus.heldout] == ["b.txt"] and [d.name for d in corpus.train] == ["a.txt"]


# ---------------------------------------------------------------- packing


def _reference_packing(docs: list[list[int]], seq_len: int, bos: int, eos: int, pad: int):
    """Plain-loop reference: label every stream token with (document, offset), then cut windows."""
    stream, owner = [], []
    for d, doc in enumerate(docs):
        for tok in [bos, *doc, eos]:
            stream.append(tok)
            owner.append(d)
    n_seq = -(-(len(stream) - 1) // seq_len)
    while len(stream) < n_seq * seq_len + 1:
        stream.append(pad)
        owner.append(-1)
    sequences = []
    for i in range(n_seq):
        lo = i * seq_len
        tokens, positions, doc_ids, targets = [], [], [], []
        doc_counter, pos = -1, 0
        for j in range(seq_len):
            t, nxt = stream[lo + j], stream[lo + j + 1]
            new_doc = j == 0 or stream[lo + j - 1] == eos
            if new_doc:
                doc_counter += 1
                pos = 0
            tokens.append(t)
            positions.append(pos)
            doc_ids.append(doc_counter)
            same_doc = owner[lo + j] == owner[lo + j + 1] and owner[lo + j] >= 0 and t != eos
            targets.append(nxt if same_doc else IGNORE_INDEX)
            pos += 1
        sequences.append((tokens, positions, doc_ids, targets))
    return sequences


@pytest.mark.parametrize("seq_len", [1, 3, 7, 16])
def test_packing_matches_plain_loop_reference(seq_len):
    tok = ByteTokenizer()
    texts = ["ab", "", "hello world", "x", "0123456789abcdef0123"]
    docs = [Document(f"d{i}", t) for i, t in enumerate(texts)]
    packed = pack_documents(docs, tok, seq_len)
    reference = _reference_packing([list(t.encode()) for t in texts], seq_len, tok.bos_id, tok.eos_id, tok.pad_id)
    assert len(packed) == len(reference)
    batch = packed.batch(list(range(len(packed))))
    for i, (tokens, positions, doc_ids, targets) in enumerate(reference):
        assert batch.tokens[i].tolist() == tokens
        assert batch.positions[i].tolist() == positions
        assert batch.document_ids[i].tolist() == doc_ids
        assert batch.targets[i].tolist() == targets


def test_every_document_token_and_eos_is_a_target_exactly_once():
    tok = ByteTokenizer()
    texts = ["first doc", "second, longer document", "3"]
    packed = pack_documents([Document(str(i), t) for i, t in enumerate(texts)], tok, seq_len=5)
    batch = packed.batch(list(range(len(packed))))
    valid = batch.targets[batch.targets != IGNORE_INDEX].tolist()
    expected = [b for t in texts for b in [*t.encode(), tok.eos_id]]
    assert valid == expected
    assert batch.n_valid_targets == len(expected)
    # Positions never exceed the sequence and document ids are dense from 0 in each row.
    for row in batch.document_ids:
        assert row[0] == 0 and set(torch.diff(row).tolist()) <= {0, 1}


def test_packing_empty_stream_gives_no_sequences():
    packed = PackedSequences(torch.empty(0, dtype=torch.int32), 8, eos_id=257, pad_id=258)
    assert len(packed) == 0
    assert encode_documents([], ByteTokenizer()).numel() == 0
