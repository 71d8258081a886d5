"""The [checkpoint] section: when checkpoints are written, kept and resumed from; its checks.

Only what the fields allow; the checkpoint files themselves are moetrain.train.checkpoint's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moetrain.config.checks import check, check_positive


@dataclass
class CheckpointConfig:
    enabled: bool = True
    """Write checkpoints."""
    every: int = 100
    """Steps between checkpoints (the last step is always saved)."""
    keep_last: int = 2
    """Complete checkpoints kept; older ones are deleted after a save."""
    resume: bool | Literal["auto"] = False
    """Resume from the newest intact checkpoint: True (one must exist), False (start fresh; refuse to
    overwrite), or "auto" (resume when a checkpoint exists, else start fresh)."""
    allow_schedule_change: bool = False
    """On resume, accept a learning-rate schedule (train.steps, warmup_steps, schedule, decay_fraction,
    min_lr_ratio, lr) other than the checkpoint's; it then bends from the resumed step on."""
    signal_save_after_s: float = 0.0
    """On SIGTERM/SIGINT the run stops at the next step boundary and saves there when a
    save is due or the last save (or the run's start) is older than this many seconds."""
    async_save: bool = False
    """Write checkpoints in the background: the training loop pays only for copying the model and
    optimizer state into host memory (kept for reuse: one more copy of that state per rank); the write,
    hashing, manifest and rename run in a thread while training continues (one save in flight)."""

    def validate(self) -> None:
        """Raise ConfigError (one line) at the first invalid [checkpoint] field."""
        check_positive(self, "checkpoint", ("every", "keep_last"))
        check(0 <= self.signal_save_after_s < float("inf"), "checkpoint.signal_save_after_s", self.signal_save_after_s,
              "must be a finite number of seconds >= 0")
