"""A checkpoint's integrity: the sha256 manifest, written last and checked before anything reads the files.

`manifest.json` holds the sha256 and size of every other file of the checkpoint. A checkpoint is
read only after every file in its directory has matched its sha256 in the manifest and no file
outside the manifest is present. sha256 rather than a cheaper checksum (crc32, xxhash): it is in
the standard library, any machine can recheck a copied checkpoint with `sha256sum`, no accidental
or crafted match is within reach, and its cost is one pass over the bytes: 0.19x the time of a
whole save of the default model's checkpoint, crc32 being 0.34x of sha256
(benchmarks/profile/checkpoint_hash_cost.py, docs/reliability.md). The manifest lives beside the files, so
it detects damage (flipped bytes, truncation, missing or extra files), not deliberate tampering:
someone who can write the directory can rewrite the manifest too. That is safe because the loader
cannot execute code whatever the files contain.

Fallback: `newest_intact()` verifies checkpoints newest first and returns the first intact one
with one line per skipped one naming its bad file; with none intact a resume stops with one line.

This module hashes and compares files; it must not parse a checkpoint's state or tensors.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from moetrain.checkpoint.layout import MANIFEST_FILE, CheckpointRef, list_complete
from moetrain.durable import file_sha256, write_durably
from moetrain.errors import ConfigError
from moetrain.parallel.collectives import all_gather_objects, rank_and_world

FORMAT = "moetrain-checkpoint-v2"


def files_under(root: Path) -> list[str]:
    """Every file below `root` as a '/'-separated relative path, sorted (symlinks count as files)."""
    found = []
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            found.append((Path(dirpath) / name).relative_to(root).as_posix())
    return sorted(found)


def manifest_entries(root: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """The manifest's entries (sha256 and size) of the files `names` under `root`."""
    return {name: {"sha256": file_sha256(root / name), "bytes": (root / name).stat().st_size} for name in names}


def write_manifest(root: Path, entries: dict[str, dict[str, Any]]) -> None:
    """Write `root`'s manifest of `entries` durably (the last file of a checkpoint)."""
    write_durably(root / MANIFEST_FILE,
                  json.dumps({"format": FORMAT, "algorithm": "sha256", "files": dict(sorted(entries.items()))},
                             indent=1))


def _read_manifest(path: Path) -> dict[str, dict[str, Any]]:
    """The manifest's file entries; ValueError (one line) when it is not a manifest of this format."""
    try:
        manifest = json.loads(path.read_bytes())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"is not readable JSON ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("algorithm") != "sha256":
        raise ValueError(f"is not a {FORMAT} sha256 manifest")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(
            isinstance(name, str) and isinstance(entry, dict) and isinstance(entry.get("sha256"), str)
            and isinstance(entry.get("bytes"), int) for name, entry in files.items()):
        raise ValueError("has a malformed file list")
    for name in files:
        if name.startswith("/") or ".." in name.split("/") or name == MANIFEST_FILE:
            raise ValueError(f"names a file outside its checkpoint: {name!r}")
    return files


def _local_problem(path: Path, part: int, parts: int) -> str | None:
    """What is wrong with checkpoint `path` (one line naming the file), checking every `parts`-th file from `part`."""
    manifest = path / MANIFEST_FILE
    if not manifest.is_file():
        if (path / ".metadata").exists():
            return (f"{path} was written by an older moetrain (pickled DCP metadata, no {MANIFEST_FILE}); "
                    "such checkpoints are not loaded")
        return f"{manifest} is missing"
    try:
        entries = _read_manifest(manifest)
    except ValueError as err:
        return f"{manifest} {err}"
    present = set(files_under(path)) - {MANIFEST_FILE}
    for name in sorted(present - entries.keys()):
        return f"{path / name} is not in the checkpoint's manifest"
    for name in sorted(entries.keys() - present):
        return f"{path / name} is missing"
    for name in sorted(entries)[part::parts]:
        file = path / name
        if file.is_symlink() or not file.is_file():  # a link to /dev/zero or a FIFO would never finish hashing
            return f"{file} is not a regular file"
        size = file.stat().st_size
        if size != entries[name]["bytes"]:
            return f"{file} has {size} bytes, the manifest says {entries[name]['bytes']} (truncated or damaged)"
        if file_sha256(file) != entries[name]["sha256"]:
            return f"{file} does not match its sha256 in the manifest (damaged)"
    return None


def verify(ref: CheckpointRef) -> tuple[CheckpointRef, str | None]:
    """(ref marked verified, None) when every file matches the manifest, else (ref, one line naming the file).

    Collective under torch.distributed (every rank calls it): each rank hashes its share of the
    files and all ranks get the same answer.
    """
    rank, world = rank_and_world()
    problems = all_gather_objects(_local_problem(ref.path, rank, world))
    problem = next((p for p in problems if p is not None), None)
    return (ref if problem else replace(ref, verified=True)), problem


def newest_intact(checkpoint_dir: str | Path) -> tuple[CheckpointRef | None, list[str]]:
    """The newest checkpoint whose files all match its manifest, and one line per newer, damaged one.

    Collective under torch.distributed. Logs nothing: the caller says what the skipped ones mean.
    """
    skipped = []
    for ref in reversed(list_complete(checkpoint_dir)):
        checked, problem = verify(ref)
        if problem is None:
            return checked, skipped
        skipped.append(problem)
    return None, skipped


def require_verified(ref: CheckpointRef) -> CheckpointRef:
    """`ref` once its files have matched the manifest (checked now unless already); ConfigError when damaged."""
    if ref.verified:
        return ref
    checked, problem = verify(ref)
    if problem is not None:
        raise ConfigError(f"checkpoint {ref.path} is damaged: {problem}")
    return checked
