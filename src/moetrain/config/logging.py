"""The [logging] section: the run directory, metrics cadence and trackers; its checks.

Only what the fields allow (a tracker's package must be installed); the loggers are moetrain.observe's.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from moetrain.config.checks import check, check_positive


@dataclass
class LoggingConfig:
    run_dir: str = "runs/tiny_moe"
    """Directory of the run: config.json, metrics.jsonl, checkpoints/, logs/."""
    log_every: int = 10
    """Steps between metrics records and console lines."""
    all_ranks_to_files: bool = False
    """Every rank writes its log to RUN_DIR/logs/ (rank 0 always logs to the console)."""
    progress_bar: bool = True
    """A tqdm progress bar on rank 0."""
    tensorboard: bool = False
    """TensorBoard event files beside metrics.jsonl (extra `tensorboard`)."""
    wandb: bool = False
    """Weights & Biases tracking beside metrics.jsonl (extra `wandb`; WANDB_MODE=offline works without network)."""
    wandb_project: str = "moetrain"
    """The Weights & Biases project."""

    def validate(self) -> None:
        """Raise ConfigError (one line) at the first invalid [logging] field."""
        check_positive(self, "logging", ("log_every",))
        check(bool(self.run_dir), "logging.run_dir", self.run_dir, "must be a non-empty path")
        check(not self.wandb or importlib.util.find_spec("wandb") is not None, "logging.wandb", self.wandb,
              "needs the `wandb` package: pip install moetrain[wandb], or set it to False")
