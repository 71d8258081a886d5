"""`data prepare --streaming`: the same shards, byte for byte, as the map-style path, read as the input goes.

The reference of every comparison is the prepare without --streaming (map-style `datasets`, the plan
made whole before anything is written), which the rest of the suite checks against the in-memory
stream and transformers. "Not materialised" is checked on what the process reads from disk
(/proc/self/io), which unlike the resident set does not depend on the allocator.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from chat_fixtures import TEMPLATES, tokenizer_dir
from moetrain.data.prepare import hf, streaming
from moetrain.data.prepare.command import PrepareArgs, prepare
from moetrain.data.shards import MANIFEST
from moetrain.errors import ConfigError

datasets = pytest.importorskip("datasets")

WORDS = "alpha beta gamma delta sky blue green snow white 日本語 🙂 what why how four".split()


def texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(0 if i % 17 == 5 else 1, 40))) for i in range(n)]


def conversations(n: int, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        messages = [{"role": "system", "content": "Be brief."}] if rng.random() < 0.4 else []
        for _ in range(rng.randint(1, 3)):
            messages.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 8)))})
            messages.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 12)))})
        out.append(messages)
    return out


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def both_ways(tmp_path: Path, inputs: list[str], **options) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """Every file of the map-style prepare and of the streaming one (with 1 and 2 workers: all equal)."""
    reference = tmp_path / "map_style"
    prepare(PrepareArgs(input=inputs, out=str(reference), quiet=True, **options))
    streamed = []
    for workers in (1, 2):
        out = tmp_path / f"streamed_{workers}"
        prepare(PrepareArgs(input=inputs, out=str(out), quiet=True, streaming=True, workers=workers, **options))
        streamed.append(tree(out))
    assert streamed[0] == streamed[1]
    return tree(reference), streamed[0]


def test_text_inputs_of_every_kind_stream_into_the_same_shards(tmp_path):
    parquet, json_lines, jsonl, folder = (tmp_path / "a.parquet", tmp_path / "b.json", tmp_path / "c.jsonl",
                                          tmp_path / "docs")
    datasets.Dataset.from_dict({"text": texts(300, 1), "n": list(range(300))}).to_parquet(str(parquet),
                                                                                           batch_size=64)
    json_lines.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts(120, 2)))
    jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts(80, 3)))
    folder.mkdir()
    for i, text in enumerate(texts(15, 4)):
        (folder / f"{(i * 7) % 15:02d}.txt").write_text(text)
    reference, streamed = both_ways(tmp_path, [str(parquet), str(json_lines), str(jsonl), str(folder)],
                                    shard_mb=0.002, heldout_fraction=0.2)
    assert sum(name.endswith(".tokens.npy") for name in reference) > 10  # many shards in both splits
    assert streamed == reference


def test_conversations_stream_into_the_same_shards_and_masks(tmp_path):
    directory = tokenizer_dir(tmp_path / "tok", TEMPLATES["llama3_generation"])
    chats = conversations(150, 5)
    chats[7][-1]["tool_calls"] = None  # a key some rows have: null elsewhere, dropped as transformers drops it
    parquet, json_lines = tmp_path / "chats.parquet", tmp_path / "chats.json"
    datasets.Dataset.from_list([{"messages": c} for c in chats]).to_parquet(str(parquet), batch_size=32)
    json_lines.write_text("".join(json.dumps({"messages": c, "id": i}) + "\n" for i, c in enumerate(chats[:60])))
    saved = tmp_path / "saved"
    datasets.Dataset.from_list([{"messages": c} for c in chats[60:]]).save_to_disk(str(saved))
    arrow = next(saved.glob("*.arrow"))
    reference, streamed = both_ways(tmp_path, [str(parquet), str(json_lines), str(arrow), str(saved)],
                                    tokenizer=str(directory), format="chat", shard_mb=0.003,
                                    heldout_fraction=0.1)
    assert any(name.endswith(".mask.npy") for name in reference)
    assert streamed == reference


def test_eleven_inputs_and_a_tiny_corpus_are_ordered_and_split_as_without_streaming(tmp_path):
    inputs = []
    for i in range(11):  # names "10:..." sort before "1:...": the input order the map-style path sorts into
        path = tmp_path / f"in{i}.json"
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts(6, 10 + i)))
        inputs.append(str(path))
    reference, streamed = both_ways(tmp_path / "eleven", inputs, shard_mb=0.0005, heldout_fraction=0.3)
    assert streamed == reference
    tiny = tmp_path / "tiny.parquet"  # no document hashes into the 5%: the last training one is held out
    datasets.Dataset.from_dict({"text": ["one document", "another one"]}).to_parquet(str(tiny))
    reference, streamed = both_ways(tmp_path / "tiny", [str(tiny)], heldout_fraction=0.05)
    assert streamed == reference
    assert json.loads(reference[MANIFEST])["heldout_documents"] == 1


def _bytes_read() -> int:
    return int(dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())["rchar"])


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="reads /proc/self/io (Linux)")
def test_the_stream_is_an_iterable_dataset_read_as_it_goes_not_materialised(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    text = "".join(rng.choices("abcdefghij ", k=1 << 20))
    rows = [text[(i * 397) % (1 << 19):][:2000] for i in range(32000)]  # 64 MB, uncompressed
    source = tmp_path / "big.parquet"
    pq.write_table(pa.table({"text": rows}), str(source), compression="none", row_group_size=250)
    size = source.stat().st_size
    reader = hf.load_dataset(str(source), "text", streaming=True)
    assert isinstance(reader, datasets.IterableDataset)

    next(streaming.streamed_rows(source, "text", ""))  # (imports and caches of a first use: not counted)
    before = _bytes_read()
    records = streaming.streamed_rows(source, "text", "")
    ref, value = next(records)
    first = _bytes_read() - before
    assert (ref.name, ref.start, value) == ("000000000000", 0, rows[0])
    # a loader that materialises (map-style `load_dataset` converts the whole file first) reads >= size here
    assert first < size / 4, f"{first} bytes read for the first row of a {size}-byte input"
    assert sum(1 for _ in records) == len(rows) - 1
    assert _bytes_read() - before >= size  # (the counter does see the whole input read)


def test_parquet_is_read_a_batch_at_a_time_however_slowly_the_rows_are_consumed(tmp_path):
    """The Arrow memory held while a Parquet input streams is a batch and a read buffer, not the file: neither a
    reader running ahead of the consumer (datasets' streaming builder scans with `Fragment.to_batches`, whose
    background reader held most of a file in Arrow buffers while the shards were tokenized), nor a whole row group
    read at once (one row group is common in files written with pyarrow's defaults). Counted in pyarrow's own
    allocated bytes, which do not depend on the allocator; the pause after the first row only gives a read-ahead
    thread the chance to show itself: a synchronous reader allocates nothing while it is not asked."""
    import time

    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(1)
    text = "".join(rng.choices("abcdefghij ", k=1 << 20))
    rows = [text[(i * 397) % (1 << 19):][:2000] for i in range(16000)]  # 32 MB, uncompressed
    for row_group_size in (250, len(rows)):
        source = tmp_path / f"rows_{row_group_size}.parquet"
        pq.write_table(pa.table({"text": rows}), str(source), compression="none", row_group_size=row_group_size)
        bound = source.stat().st_size / 4
        next(streaming.streamed_rows(source, "text", ""))  # (imports and caches of a first use)
        records = streaming.streamed_rows(source, "text", "")
        next(records)
        held = pa.total_allocated_bytes()
        paused = time.monotonic()
        while held < bound and time.monotonic() - paused < 1.0:
            time.sleep(0.01)
            held = max(held, pa.total_allocated_bytes())
        n_rows = 1
        for _ in records:
            n_rows += 1
            held = max(held, pa.total_allocated_bytes())
        assert n_rows == len(rows)
        assert held < bound, f"{held} bytes of Arrow memory held streaming a {source.stat().st_size}-byte file " \
                             f"of row groups of {row_group_size} rows"


def test_a_json_array_is_refused_with_streaming_and_bad_records_are_one_line(tmp_path):
    array = tmp_path / "array.json"
    array.write_text(json.dumps([{"text": t} for t in texts(5, 6)]))
    with pytest.raises(ConfigError, match="one JSON array, which `datasets` reads whole") as info:
        prepare(PrepareArgs(input=[str(array)], out=str(tmp_path / "a"), quiet=True, streaming=True))
    assert "\n" not in str(info.value) and not (tmp_path / "a" / MANIFEST).exists()

    directory = tokenizer_dir(tmp_path / "tok", TEMPLATES["qwen_chatml"])
    chats = conversations(30, 7)
    chats[21] = [{"role": "user", "content": "no answer"}]
    source = tmp_path / "chats.parquet"
    datasets.Dataset.from_list([{"messages": c} for c in chats]).to_parquet(str(source))
    out = tmp_path / "c"
    with pytest.raises(ConfigError, match=rf"{source} row 21: .*no assistant turn") as info:
        prepare(PrepareArgs(input=[str(source)], out=str(out), tokenizer=str(directory), format="chat",
                            quiet=True, streaming=True, shard_mb=0.001, heldout_fraction=0.0))
    assert "\n" not in str(info.value) and not (out / MANIFEST).exists()  # nothing to train on
    assert (out / "train" / "shard_00000.mask.npy").is_file()  # shards finished before the bad row are kept
    with pytest.raises(ConfigError, match=rf"{source} row 21: "):  # and the rerun continues over them (their
        prepare(PrepareArgs(input=[str(source)], out=str(out), tokenizer=str(directory), format="chat",  # mask
                            quiet=True, streaming=True, shard_mb=0.001, heldout_fraction=0.0))  # files are its own)
    manifest = prepare(PrepareArgs(input=[str(source)], out=str(tmp_path / "skipped"), tokenizer=str(directory),
                                   format="chat", quiet=True, streaming=True, shard_mb=0.001, heldout_fraction=0.0,
                                   skip_bad_files=True))
    assert manifest["chat"]["skipped_documents"] == 1 and manifest["train_documents"] == 29
    with pytest.raises(ConfigError, match="--text-field / --messages-field 'conversation' is not a column"):
        prepare(PrepareArgs(input=[str(source)], out=str(tmp_path / "d"), tokenizer=str(directory),
                            format="chat", quiet=True, streaming=True, messages_field="conversation"))


def test_a_streaming_rerun_continues_a_prepare_and_refuses_shards_of_other_inputs(tmp_path):
    source = tmp_path / "docs.parquet"
    datasets.Dataset.from_dict({"text": texts(200, 8)}).to_parquet(str(source))
    out = tmp_path / "out"
    prepare(PrepareArgs(input=[str(source)], out=str(out), quiet=True, shard_mb=0.002))
    finished = tree(out)
    prepare(PrepareArgs(input=[str(source)], out=str(out), quiet=True, shard_mb=0.002, streaming=True))
    assert tree(out) == finished  # every shard had the same plan: nothing rewritten, the same manifest
    other = tmp_path / "other.parquet"
    datasets.Dataset.from_dict({"text": texts(200, 9)}).to_parquet(str(other))
    with pytest.raises(ConfigError, match="is a finished shard of other inputs or options"):
        prepare(PrepareArgs(input=[str(other)], out=str(out), quiet=True, shard_mb=0.002, streaming=True))
    assert {k: v for k, v in tree(out).items()} == finished  # nothing rewritten
