"""Optional experiment tracking beside metrics.jsonl: Weights & Biases (`logging.wandb = true`, extra `wandb`).

`WandbTracker` opens one W&B run in RUN_DIR/wandb/ with the job's resolved config, and
`log(record)` sends a metrics record's numbers under "<kind>/<field>" at the record's step;
a list (per rank, per MoE layer) becomes one series per index ("train/peak_rss_bytes_per_rank/2").
Offline mode needs no network: `WANDB_MODE=offline` (W&B's own variable) keeps the run on
disk for a later `wandb sync`. The run's id is kept in RUN_DIR/wandb_run_id, so a job restarted in
the same run directory (a resume, a torchrun restart) continues its W&B run; metrics.jsonl stays
the record of truth. Called by `MetricsWriter` on rank 0 only; this module decides nothing about
what is measured, and `wandb` is imported only when tracking is on.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

from moetrain.durable import write_atomically
from moetrain.errors import ConfigError
from moetrain.runtime.run_dir import RunDir


def _numbers(prefix: str, value: Any) -> dict[str, float]:
    if isinstance(value, bool) or value is None:
        return {}
    if isinstance(value, (int, float)):
        return {prefix: value}
    if isinstance(value, list):
        out: dict[str, float] = {}
        for index, item in enumerate(value):
            out.update(_numbers(f"{prefix}/{index}", item))
        return out
    return {}


def flatten_record(record: dict[str, Any]) -> dict[str, float]:
    """A metrics record's numeric fields as "<kind>/<field>[/<index>]" -> number (text and flags left out)."""
    kind = record.get("kind", "train")
    out: dict[str, float] = {}
    for key, value in record.items():
        if key not in ("kind", "step"):
            out.update(_numbers(f"{kind}/{key}", value))
    return out


def run_id(run_dir: RunDir) -> str:
    """The W&B run id stored in the run directory, else a new one stored there first (written atomically)."""
    path = run_dir.wandb_run_id
    if path.is_file():
        stored = path.read_text(encoding="utf-8").strip()
        if stored.isalnum():
            return stored
    fresh = secrets.token_hex(8)  # W&B takes any letters and digits as an id
    write_atomically(path, lambda handle: handle.write(fresh.encode()))
    return fresh


class WandbTracker:
    """One W&B run for this job; `log` takes metrics records, `finish` closes the run."""

    def __init__(self, run_dir: Path, config: dict[str, Any], project: str):
        try:
            import wandb  # the optional extra: only needed when logging.wandb is on
        except ImportError:
            raise ConfigError("logging.wandb = True needs the `wandb` package, which is not installed; install the "
                              "extra `pip install moetrain[wandb]` or set it to False") from None
        run_dir.mkdir(parents=True, exist_ok=True)
        self._wandb = wandb
        self._run = wandb.init(project=project, name=run_dir.name, dir=str(run_dir), config=config,
                               id=run_id(RunDir(run_dir)), resume="allow",
                               settings=wandb.Settings(console="off"))

    def log(self, record: dict[str, Any]) -> None:
        numbers = flatten_record(record)
        if numbers:
            self._run.log(numbers, step=int(record.get("step", 0)))

    def finish(self) -> None:
        self._run.finish()
        # finish() returns before W&B's service process has written everything of an offline run;
        # teardown waits for it, so the run directory is complete when the job returns.
        self._wandb.teardown()
