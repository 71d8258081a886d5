"""The layout of a run directory and the config a run stored there.

RUN_DIR/config.json (the run's resolved JobConfig), metrics.jsonl (records, see
`moetrain.train.metrics`), checkpoints/step_XXXXXXXX/ (see `moetrain.train.checkpoint`),
logs/rank{R}.log (optional per-rank logs), profile/rank{R}_steps{A}-{B}.json (torch.profiler
traces, `profile.steps`) and training_curve.png (`moetrain plot`).
Every reader and writer of a run directory takes its paths from here. This module
names paths and reads the stored config; it writes nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from moetrain.config import JobConfig, from_dict
from moetrain.errors import ConfigError

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.jsonl"


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def config(self) -> Path:
        return self.root / CONFIG_FILE

    @property
    def metrics(self) -> Path:
        return self.root / METRICS_FILE

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def curve(self) -> Path:
        return self.root / "training_curve.png"

    @property
    def profile(self) -> Path:
        return self.root / "profile"

    def load_config(self) -> JobConfig:
        """The JobConfig a training run saved here (one-line ConfigError when missing or bad)."""
        if not self.config.is_file():
            raise ConfigError(f"--run {str(self.root)!r} has no {CONFIG_FILE}; pass the logging.run_dir of a "
                              "training run")
        try:
            return from_dict(json.loads(self.config.read_text())).validate()
        except json.JSONDecodeError as err:
            raise ConfigError(f"{self.config} is not valid JSON: {err}") from None
