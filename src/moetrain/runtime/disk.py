"""A full disk while a run writes its files: one line naming the path, not a traceback.

`no_space_left(path, what)` wraps a write (metrics record, config, checkpoint). When the
write fails because the file system is full or over quota (ENOSPC, EDQUOT) — raised
directly, chained, or carried by torch.distributed.checkpoint's `CheckpointException`
from any rank — it raises `ConfigError` ("no space left on device ... PATH"), which the
CLI prints as one line with exit status 2. A full disk does not always surface as an
errno: `torch.save` into a full file system fails with a RuntimeError from its zip writer
("unexpected pos ..."), so a failed write whose file system has less than
`NEARLY_FULL_BYTES` free is reported the same way. Any other failure passes through unchanged.
What was complete before the failed write stays usable: a checkpoint that could not be
finished stays a temporary directory (removed at the next start), and a metrics record
is cut back to the last whole line (`append_line`). This module decides nothing else
about the run and does no collectives.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from moetrain.errors import ConfigError

FULL_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# Free space below which a failed write is blamed on the disk (a metrics record or a shard header
# needs more than this; a healthy file system rarely sits this close to full).
NEARLY_FULL_BYTES = 1 << 20


def free_bytes(path: str | Path) -> int | None:
    """Bytes available to this user on the file system holding `path` (or its nearest existing parent)."""
    candidate = Path(path).absolute()
    while not candidate.exists() and candidate != candidate.parent:
        candidate = candidate.parent
    try:
        return shutil.disk_usage(candidate).free
    except OSError:
        return None


def find_full_disk_error(err: BaseException) -> OSError | None:
    """The ENOSPC/EDQUOT OSError behind `err` (itself, its causes, or a DCP rank failure), or None."""
    pending: list[BaseException] = [err]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in FULL_DISK_ERRNOS:
            return current
        pending += [e for e in (current.__cause__, current.__context__) if e is not None]
        # torch.distributed.checkpoint.api.CheckpointException: {rank: (exception, stack summary)}.
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            for failure in failures.values():
                inner = failure[0] if isinstance(failure, tuple) and failure else failure
                if isinstance(inner, BaseException):
                    pending.append(inner)
    return None


@contextmanager
def no_space_left(path: str | Path, what: str) -> Iterator[None]:
    """Turn a full-disk failure of the enclosed write of `what` at `path` into a one-line ConfigError."""
    try:
        yield
    except BaseException as err:  # DCP's CheckpointException derives from BaseException
        full = find_full_disk_error(err)
        if full is not None:
            where, why = (full.filename or path), full.strerror or os.strerror(full.errno)
        elif isinstance(err, (Exception, CheckpointException)):
            free = free_bytes(path)
            if free is None or free >= NEARLY_FULL_BYTES:
                raise
            where, why = path, f"{type(err).__name__} with {free} bytes free on its file system"
        else:
            raise
        raise ConfigError(f"no space left on device writing the {what} {str(where)!r} ({why}); free space and run "
                          "again (--checkpoint.resume True continues from the newest complete checkpoint)") from None


def append_line(path: Path, line: str) -> None:
    """Append `line` + newline to `path`; on failure cut the file back so it ends with a whole line."""
    size = path.stat().st_size if path.exists() else 0
    try:
        with path.open("a") as fh:
            fh.write(line + "\n")
    except OSError:
        try:
            os.truncate(path, size)  # a partial record would break every reader of the file
        except OSError:
            pass
        raise
