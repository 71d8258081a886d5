"""The documents of `data prepare`'s inputs, as references (DocRef): where each one's text is, not the text.

Documents are named as the matching data.source names them (a path relative to the input,
`FILE:LINE`, a row number; with several inputs the input's index is prefixed) and sorted by
name, so the plan never depends on the file system's order. Only a list of references,
O(documents), is held (none with --streaming, which makes them as it goes). This module finds
documents; it does not read their text (the workers do), split or tokenize them.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetrain.data.corpus import files_under, stdlib_files, utf8_name
from moetrain.data.prepare.hf import DATASET_FILES, HF_PREFIX, load_dataset
from moetrain.errors import ConfigError


@dataclass(frozen=True)
class DocRef:
    """Where one document's text is: a whole file, a line of a .jsonl file (byte range) or a dataset row."""

    name: str
    kind: str  # "file" | "line" | "row"
    path: str
    start: int = 0
    length: int = 0  # bytes (an estimate for rows), for cutting shards


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file()


def _jsonl_refs(path: Path, prefix: str) -> Iterator[DocRef]:
    position = 0
    with open(path, "rb") as handle:
        for line_no, line in enumerate(handle, start=1):
            if line.strip():
                yield DocRef(f"{prefix}{path.name}:{line_no:09d}", "line", str(path), position, len(line))
            position += len(line)


def row_bytes(path: str, n_rows: int, dataset: Any = None) -> int:
    """The size estimate of one row (the input's bytes over its rows), for cutting shards: a function of the
    input alone, so a streaming prepare (which knows the rows only as they pass) cuts where this one does."""
    if path.startswith(HF_PREFIX):  # the Arrow files of the cache entry
        data_bytes = sum(os.path.getsize(f["filename"]) for f in dataset.cache_files)
    else:
        data_bytes = Path(path).stat().st_size if Path(path).is_file() else sum(
            f.stat().st_size for f in Path(path).rglob("*.arrow"))
    return max(1, data_bytes // max(1, n_rows))


def _dataset_refs(path: str, text_field: str, prefix: str, hf: tuple[str | None, str]) -> Iterator[DocRef]:
    path = path if path.startswith(HF_PREFIX) else str(Path(path))  # the name the plan always had
    dataset = load_dataset(path, text_field, hf)
    per_row = row_bytes(path, len(dataset), dataset)
    return (DocRef(f"{prefix}{i:012d}", "row", path, i, per_row) for i in range(len(dataset)))


def is_row_input(spec: str) -> bool:
    path = Path(spec)
    return spec.startswith(HF_PREFIX) or (path.is_dir() and _is_saved_dataset(path)) or (
        path.is_file() and path.suffix in DATASET_FILES)


def input_refs(spec: str, prefix: str, glob: str, text_field: str, skip_bad: bool,
               hf: tuple[str | None, str]) -> Iterator[DocRef]:
    """One input's documents: rows and .jsonl lines in their order (so by name), files in any order."""
    if spec.startswith(HF_PREFIX) or is_row_input(spec):
        return _dataset_refs(spec, text_field, prefix, hf)
    if spec == "stdlib":
        root, files = stdlib_files()
    else:
        path = Path(spec)
        if path.is_file() and path.suffix == ".jsonl":
            return _jsonl_refs(path, prefix)
        if path.is_file():
            root, files = path.parent, [path]
        elif path.is_dir():
            root, files = path, files_under(path, glob)
        else:
            raise ConfigError(f"--input {spec!r} is neither a file, a directory nor 'stdlib'")
    return (DocRef(prefix + f.relative_to(root).as_posix(), "file", str(f), 0, f.stat().st_size) for f in files
            if utf8_name(f.relative_to(root).as_posix(), skip_bad))


def document_refs(inputs: list[str], glob: str, text_field: str, skip_bad: bool = False,
                  hf: tuple[str | None, str] = (None, "train")) -> list[DocRef]:
    """Every input's documents, sorted by name (file names that are not UTF-8: an error, or skipped)."""
    refs: list[DocRef] = []
    for index, spec in enumerate(inputs):
        refs += input_refs(spec, f"{index}:" if len(inputs) > 1 else "", glob, text_field, skip_bad, hf)
    if not refs:
        raise ConfigError(f"--input {' '.join(inputs)} holds no documents")
    return sorted(refs, key=lambda r: r.name)


class _Unread(enum.Enum):
    """A record's value not read yet (the worker reads it from its DocRef), as opposed to one streamed in with
    it. An enum member, so it stays the same object when a job is sent to a worker process."""

    UNREAD = 0


UNREAD: Any = _Unread.UNREAD
