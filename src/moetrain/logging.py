"""Rank-aware logging: every record carries `[rank=R]`; rank 0 writes to the console.

The rank comes from the initialised process group, else the RANK environment
variable, else 0. Other ranks are silent on the console unless asked, and can each
write a per-rank log file. This module configures logging only; it decides nothing
about training.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import torch.distributed as dist

_LOGGER_NAME = "moetrain"


def current_rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = current_rank()
        return True


_FORMAT = "[rank=%(rank)d] %(asctime)s %(levelname)s %(message)s"


def setup_logging(
    level: int = logging.INFO,
    all_ranks_to_console: bool = False,
    log_dir: str | Path | None = None,
) -> logging.Logger:
    """Configure the `moetrain` logger for this process (idempotent)."""
    logger = logging.getLogger(_LOGGER_NAME)
    logger.setLevel(level)
    logger.propagate = False
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    formatter = logging.Formatter(_FORMAT, datefmt="%H:%M:%S")
    rank = current_rank()
    if rank == 0 or all_ranks_to_console:
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(formatter)
        console.addFilter(_RankFilter())
        logger.addHandler(console)
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(Path(log_dir) / f"rank{rank}.log")
        file_handler.setFormatter(formatter)
        file_handler.addFilter(_RankFilter())
        logger.addHandler(file_handler)
    if not logger.handlers:
        # A silent rank still needs a handler, or Python's last-resort handler prints its warnings.
        logger.addHandler(logging.NullHandler())
    return logger


def get_logger(name: str | None = None) -> logging.Logger:
    logger = logging.getLogger(_LOGGER_NAME if name is None else f"{_LOGGER_NAME}.{name}")
    if not any(isinstance(f, _RankFilter) for f in logger.filters):
        logger.addFilter(_RankFilter())
    return logger


def print_rank(*values: object, ranks: int | list[int] | None = None) -> None:
    """Debug print from any rank, prefixed with the rank; `ranks` restricts who prints."""
    rank = current_rank()
    if ranks is not None and rank not in ([ranks] if isinstance(ranks, int) else ranks):
        return
    print(f"[rank={rank}]", *values, flush=True)
