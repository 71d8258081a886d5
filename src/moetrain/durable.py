"""Durable files: a file's sha256, fsync of a file or directory, and writes that are all-or-nothing.

Data shards and checkpoints both promise that a file with its final name is complete and that
its checksum can be verified later; the helpers that keep those promises live here once.
Standard library only; this module knows nothing of shards, checkpoints or configs.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

# Large enough that hashing is bound by the disk or memory bandwidth, not by Python calls.
HASH_CHUNK = 8 << 20


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_dir(directory: Path) -> None:
    """Make the renames in `directory` durable across a power loss, not only a process kill.

    A directory that cannot be opened (some filesystems refuse O_RDONLY on directories) is left
    as it is: the renames are then only as durable as the filesystem makes them.
    """
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, text: str) -> None:
    """Write `text` to `path` and fsync it (no rename: for files inside a directory renamed later)."""
    with open(path, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def write_atomically(path: Path, write: Callable[[IO[bytes]], Any], sync_dir: bool = True) -> None:
    """Call write(handle) on a temporary file beside `path`, fsync it, then rename it to `path`.

    `sync_dir=False` leaves the directory fsync (which makes the rename durable) to the caller,
    so that several renames in one directory share one.
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as handle:
        write(handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    if sync_dir:
        fsync_dir(path.parent)


def write_json_atomically(path: Path, data: Any) -> None:
    write_atomically(path, lambda handle: handle.write((json.dumps(data, indent=1) + "\n").encode("utf-8")))
