"""The output directory of `data prepare`: which --out a prepare may write into, and a failed write as one line.

--out must be a new or empty directory, or one that holds nothing but a prepare's own files
(manifest.json of this format, train/ and heldout/ shard files): anything else (a checkpoint's
manifest.json, the user's files, an input directory) is refused in one line before anything is
written. A write that fails (disk full, read-only or unwritable directory) is one line naming
the path; what was finished stays, and a rerun continues from it. This module checks and tidies
--out; it does not write shards or the manifest (moetrain.data.shards does).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from moetrain.data.shards import FORMAT as SHARDS_FORMAT
from moetrain.data.shards import MANIFEST, SPLITS
from moetrain.errors import ConfigError

# What a prepare's output directory may hold: its manifest (and the temporary name it is written
# under), and per split the shard files, their entries and the temporary files of unfinished shards.
_SPLIT_FILE = re.compile(r"^(shard_\d{5,}\.(tokens\.npy|offsets\.npy|mask\.npy|json)"
                         r"|\.shard_\d{5,}\.[a-z.]+\.tmp-\d+)$")
_TOP_FILE = re.compile(rf"^({re.escape(MANIFEST)}|\.{re.escape(MANIFEST)}\.tmp-\d+)$")


def _foreign_entry(out: Path) -> str | None:
    """The first entry of an existing --out that is not a prepare's own file (one line), or None."""
    for entry in sorted(out.iterdir()):
        if entry.name in SPLITS and entry.is_dir() and not entry.is_symlink():
            for inner in sorted(entry.iterdir()):
                if not (_SPLIT_FILE.match(inner.name) and inner.is_file() and not inner.is_symlink()):
                    return f"{inner} is not a token shard file"
        elif not (_TOP_FILE.match(entry.name) and entry.is_file() and not entry.is_symlink()):
            return f"it holds {entry.name!r}, which `moetrain data prepare` does not write"
        elif entry.name == MANIFEST:
            try:
                manifest = json.loads(entry.read_bytes())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError):
                manifest = None
            if not isinstance(manifest, dict) or manifest.get("format") != SHARDS_FORMAT:
                return f"its {MANIFEST} is not a token-shard manifest (a checkpoint's, or another tool's)"
    return None


def check_output_dir(out: Path, inputs: list[str]) -> None:
    """Refuse (one line, before anything is written) an --out that a prepare must not write into."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {str(out)!r} is not a directory; choose a new or empty directory")
    resolved = out.resolve()
    for spec in inputs:
        if spec != "stdlib" and Path(spec).is_dir() and resolved.is_relative_to(Path(spec).resolve()):
            raise ConfigError(f"--out {str(out)!r} is inside --input {spec!r}: its shards would be read as "
                              "documents; choose a directory outside the inputs")
    if out.is_dir():
        try:
            foreign = _foreign_entry(out)
        except OSError as err:
            raise ConfigError(f"--out {str(out)!r} cannot be read: {err.strerror or err}") from None
        if foreign is not None:
            raise ConfigError(f"--out {str(out)!r} already exists and is not an unfinished prepare of these "
                              f"inputs ({foreign}); choose a new or empty directory")
        if not os.access(out, os.W_OK | os.X_OK):
            raise ConfigError(f"--out {str(out)!r} is not writable by this user; choose another directory")
        return
    parent = out.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"--out {str(out)!r} is below {str(parent)!r}, which is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {str(out)!r} cannot be created: {str(parent)!r} is not writable by this user")


def _nearly_full(out: Path) -> bool:
    # numpy's writer reports a short write as a bare OSError without an errno (as moetrain.runtime.disk notes
    # of torch's): with under 1 MiB left on the file system, that is the disk being full.
    try:
        return shutil.disk_usage(out if out.exists() else out.absolute().parent).free < 1 << 20
    except OSError:
        return False


@contextmanager
def writes_to(out: Path) -> Iterator[None]:
    """A failed write into --out (disk full, read-only, unwritable) as one ConfigError line naming the path."""
    try:
        yield
    except OSError as err:
        where = err.filename or out
        if err.errno in (errno.ENOSPC, errno.EDQUOT) or (err.errno is None and _nearly_full(out)):
            raise ConfigError(f"no space left on device writing --out {str(out)!r} ({where}); finished shards are "
                              "kept: free space and run the same command again to continue") from None
        raise ConfigError(f"cannot write --out {str(out)!r}: {err.strerror or type(err).__name__} ({where}); "
                          "choose a writable directory") from None


def remove_partial_files(out: Path) -> None:
    """Remove the files an interrupted run cut short: never complete, never renamed, only in the way."""
    for split in SPLITS:
        for partial in (out / split).glob(".shard_*.tmp-*") if (out / split).is_dir() else []:
            partial.unlink()
