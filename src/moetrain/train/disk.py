"""A full disk while a run writes its files: one line naming the path, not a traceback.

`no_space_left(path, what)` wraps a write (metrics record, config, checkpoint). When the
write fails because the file system is full or over quota (ENOSPC, EDQUOT) — raised
directly, chained, or carried by torch.distributed.checkpoint's `CheckpointException`
from any rank — it raises `ConfigError` ("no space left on device ... PATH"), which the
CLI prints as one line with exit status 2. Any other failure passes through unchanged.
What was complete before the failed write stays usable: a checkpoint that could not be
finished stays a temporary directory (removed at the next start), and a metrics record
is cut back to the last whole line (`append_line`). This module decides nothing else
about the run and does no collectives.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from moetrain.errors import ConfigError

FULL_DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


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
        if full is None:
            raise
        where = full.filename if full.filename else path
        raise ConfigError(f"no space left on device writing the {what} {str(where)!r} "
                          f"({full.strerror or os.strerror(full.errno)}); free space, then resume with "
                          "--checkpoint.resume True") from None


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
