"""--streaming: the records of every input in name order, read a batch at a time as the shards are planned.

.json / .arrow files are read as an IterableDataset (`load_dataset(..., streaming=True)`), .parquet files a
batch at a time with pyarrow's `ParquetFile.iter_batches` (with that IterableDataset's features;
`_parquet_tables` says why not through it); the plan then takes the records as they pass
(moetrain.data.prepare.plan.streamed_shards): no reference per document, no copy of the input, memory
bounded by a batch of rows, the open shards and the jobs queued. Its shards are byte-identical to the
map-style path's (the same names, split, cut and plan keys). Not the default: the map-style path plans
everything, and refuses any foreign shard, before writing, and its workers read their rows in parallel.
This module reads records; it does not plan shards, tokenize or write.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from moetrain.data.prepare.hf import DATASET_FILES, HF_PREFIX, load_dataset
from moetrain.data.prepare.inputs import UNREAD, DocRef, input_refs, is_row_input, row_bytes
from moetrain.errors import ConfigError
from moetrain.libc import M_MMAP_THRESHOLD, glibc_mallopt


def _json_array(path: Path) -> bool:
    with open(path, "rb") as handle:
        head = handle.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head.startswith(b"[")


# --streaming Parquet: rows per Arrow batch, and the read buffer through which a row group's pages are read (so a
# file of one huge row group is read a page at a time, not a column chunk at a time).
PARQUET_BATCH_ROWS = 1024
PARQUET_BUFFER_BYTES = 1 << 20


def _parquet_tables(path: Path, field: str, arrow_schema: Any) -> Iterator[Any]:
    """The `field` column of a Parquet file as Arrow tables of PARQUET_BATCH_ROWS rows, cast to `arrow_schema` (the
    features `datasets` casts every batch to), read synchronously by `pyarrow.parquet.ParquetFile.iter_batches`.

    Not `datasets`' streaming Parquet builder: it scans with `pyarrow.dataset` `Fragment.to_batches`, whose
    background reader runs ahead of a slower consumer without bound (batch_readahead=0 notwithstanding; apache/
    arrow#39808): while the shards were tokenized it held Arrow buffers of most of the file (pyarrow's
    allocated bytes peaked at 50 MiB of a 64 MB input, 12 MiB of a 16 MB one), the growth of peak memory with the
    input that --streaming was meant to remove. iter_batches reads a batch only when asked."""
    import pyarrow
    import pyarrow.parquet
    from datasets.table import table_cast

    reader = pyarrow.parquet.ParquetFile(path, pre_buffer=False, buffer_size=PARQUET_BUFFER_BYTES)
    for batch in reader.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[field], use_threads=False):
        table = pyarrow.Table.from_batches([batch])
        yield table if arrow_schema is None else table_cast(table, arrow_schema)


def streamed_rows(path: Path, field: str, prefix: str) -> Iterator[tuple[DocRef, Any]]:
    """(reference, value) of each row of a .parquet / .json / .arrow file, a batch of rows in memory at a time:
    JSON Lines and Arrow through `datasets.load_dataset(..., streaming=True)` (an IterableDataset), Parquet through
    `_parquet_tables` with the features that IterableDataset has. The references are those the map-style path
    makes (row index; the input's bytes over its rows), so the plan and the shards are the same."""
    if path.suffix == ".json" and _json_array(path):
        raise ConfigError(f"--streaming: {path} is one JSON array, which `datasets` reads whole into memory; "
                          "write it as JSON Lines (an object per line) or Parquet, or prepare without --streaming")
    stream = load_dataset(str(path), field, streaming=True).select_columns([field])
    features = stream.features
    if path.suffix == ".parquet":  # the footer's row count: nothing read twice
        import pyarrow.parquet

        n_rows = pyarrow.parquet.ParquetFile(path).metadata.num_rows
        tables = _parquet_tables(path, field, None if features is None else features.arrow_schema)
    else:  # a first pass, as Arrow tables (no Python objects), to count the rows the shard plan divides by
        n_rows = sum(table.num_rows for table in stream.with_format("arrow").iter(batch_size=1024))
        tables = stream.with_format("arrow").iter(batch_size=1024)
    per_row = row_bytes(str(path), n_rows)
    import pyarrow

    pool = pyarrow.default_memory_pool()
    index = -1
    # Each column turned into Python values as the map-style Dataset's rows are (to_pylist, then the features' own
    # decoding: `datasets` stores lists of objects whose keys differ from row to row as JSON strings, decoded on
    # the way out), and the memory of each batch handed back: Arrow's default pool (mimalloc) keeps it otherwise.
    for table in tables:
        values = table.column(field).to_pylist()
        for value in features.decode_column(values, field) if features is not None else values:
            index += 1
            yield DocRef(f"{prefix}{index:012d}", "row", str(path), index, per_row), value
        del table, values
        pool.release_unused()
    if index + 1 != n_rows:
        raise ConfigError(f"--input {str(path)!r} held {n_rows} rows when counted and {index + 1} when read: "
                          "it changed during the prepare; run it again")


def streamed_records(inputs: list[str], glob: str, field: str, skip_bad: bool,
                     hf: tuple[str | None, str]) -> Iterator[tuple[DocRef, Any]]:
    """--streaming: every input's documents in name order (the order `document_refs` sorts them into), each
    with its value where it was read from a stream (else UNREAD: a worker reads it from the reference), made
    as they are reached: no list of all documents, no copy of an input."""
    prefixes = [f"{index}:" if len(inputs) > 1 else "" for index in range(len(inputs))]
    last = None
    for index in sorted(range(len(inputs)), key=lambda i: prefixes[i]):  # names of input i all start prefixes[i]
        spec, path = inputs[index], Path(inputs[index])
        if not spec.startswith(HF_PREFIX) and path.is_file() and path.suffix in DATASET_FILES:
            records: Iterator[tuple[DocRef, Any]] = streamed_rows(path, field, prefixes[index])
        else:  # .jsonl lines by byte range, memory-mapped Arrow rows by index, files by name
            refs = input_refs(spec, prefixes[index], glob, field, skip_bad, hf)
            if not (spec.startswith(HF_PREFIX) or is_row_input(spec) or path.suffix == ".jsonl"):
                refs = iter(sorted(refs, key=lambda r: r.name))
            records = ((ref, UNREAD) for ref in refs)
        for ref, value in records:
            if last is not None and ref.name <= last:
                raise ConfigError(f"--streaming: document {ref.name!r} comes after {last!r} in --input {spec!r}, "
                                  "not in name order; prepare without --streaming")
            last = ref.name
            yield ref, value


def map_large_allocations() -> None:
    """--streaming: every allocation of 1 MiB or more gets its own memory map, returned when it is freed.

    glibc raises its mmap threshold to the size of each large block freed, so after the first, the next ones
    (datasets' JSON reader reads JSON Lines in 10 MiB chunks) come from the heap, where fragmentation kept them:
    the peak RSS of benchmarks/profile/prepare_streaming.py grew 434 / 458 / 478 MB for 16 / 64 / 258 MB of JSON Lines,
    and was 430 / 448 / 450 MB with the threshold fixed (MALLOC_MMAP_THRESHOLD_=1048576, what this sets while the
    process runs; a fixed threshold turns the dynamic one off). Where there is no glibc mallopt, nothing is done."""
    mallopt = glibc_mallopt()
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, 1 << 20)
