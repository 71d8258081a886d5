"""Training metrics: what a step record holds, when records are written, JSONL, the progress bar, TensorBoard.

The trainer measures and reduces the numbers across ranks; this module decides when
a record is due (`MetricsWriter.due(step)`: every `logging.log_every` steps and at
the run's last step), shapes the records and the console line, and stores them.
Records are one JSON object per line in `RUN_DIR/metrics.jsonl`, with a `kind` of
"train" (every log step), "eval" (held-out loss / bits per byte), "event" (start,
resume, skipped step) or "final". A resumed run appends to the same file, so a step
can appear twice (once before an interruption, once after). When the resume record is
written, every earlier record of a later step than the resume's (the history the run left:
steps past its checkpoint, or past a damaged checkpoint it fell back from) is marked
`"superseded": true` in place (the file is rewritten atomically; a line cut short by a kill
is dropped), so readers that skip marked records see one history; readers
(`moetrain.observe.plot.read_records`) skip them and keep the last record per (kind, step).
This module does no collectives.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from moetrain.durable import write_atomically
from moetrain.errors import ConfigError
from moetrain.observe.tracking import WandbTracker
from moetrain.runtime.disk import append_line, no_space_left
from moetrain.runtime.run_dir import METRICS_FILE

LN2 = math.log(2.0)


def bits_per_byte(loss_sum_nats: float, n_bytes: int) -> float:
    """Total cross-entropy (nats) over the text's UTF-8 byte count, in bits."""
    return loss_sum_nats / (LN2 * n_bytes) if n_bytes > 0 else float("nan")


@dataclass(kw_only=True)
class StepResult:
    """What one optimizer step measured on this rank (loss and aux already reduced over ranks); fields by name."""

    loss: float
    aux_loss: float
    grad_norm: float
    lr: float
    global_tokens: int
    compute_s: float
    wait_s: float
    step_s: float
    skipped: bool
    expert_load: torch.Tensor | None
    # Expert parallelism: seconds in the token all-to-alls (forward and backward; not part of
    # compute_s) and routed rows sent to / received from other ranks by the dispatches.
    all_to_all_s: float = 0.0
    all_to_all_rows_sent: int = 0
    all_to_all_rows_received: int = 0
    z_loss: float = 0.0  # the router z-loss term (with its coefficient), apart from aux_loss
    phases: dict[str, float] | None = None  # seconds per phase of the step (moetrain.observe.step_phases)
    mtp_loss: float | None = None  # the multi-token-prediction loss (1/D) Σ_k CE_k; None when not trained


class MetricsWriter:
    """Appends records to RUN_DIR/metrics.jsonl (and TensorBoard, W&B when asked); a no-op off rank 0.

    `wandb_config` (the job's resolved config) turns on W&B tracking (`moetrain.observe.tracking`).
    """

    def __init__(self, run_dir: str | Path, enabled: bool, tensorboard: bool = False, log_every: int = 1,
                 last_step: int | None = None, wandb_config: dict[str, Any] | None = None,
                 wandb_project: str = "moetrain"):
        self.enabled = enabled
        self.log_every = log_every
        self.last_step = last_step
        self.path = Path(run_dir) / METRICS_FILE
        self._tb = None
        self._wandb = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if tensorboard:
                self._tb = _tensorboard_writer(Path(run_dir) / "tensorboard")
            if wandb_config is not None:
                self._wandb = WandbTracker(Path(run_dir), wandb_config, wandb_project)

    def due(self, step: int) -> bool:
        """Whether a train record is written after `step` (on every rank: building one may communicate)."""
        return step % self.log_every == 0 or step == self.last_step

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with no_space_left(self.path, "metrics file"):
            if record.get("kind") == "event" and record.get("event") == "resume":
                mark_superseded(self.path, record["step"])
            append_line(self.path, json.dumps(record, allow_nan=True))
        if self._tb is not None and "step" in record:
            for key, value in record.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                    self._tb.add_scalar(f"{record.get('kind', 'train')}/{key}", value, record["step"])
        if self._wandb is not None:
            self._wandb.log(record)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def mark_superseded(path: Path, resume_step: int) -> int:
    """Mark every record of `path` with a step after `resume_step` as superseded; return how many were marked.

    Rewrites the file atomically (temporary file, fsync, rename) only when something changes. A line
    that is not JSON (cut short by a kill mid-write) is dropped: appended to, it would become a bad
    line in the middle of the file.
    """
    if not path.is_file():
        return 0
    lines, changed, marked = [], False, 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            changed = changed or bool(line.strip())
            continue
        step = record.get("step") if isinstance(record, dict) else None
        if (isinstance(step, int) and not isinstance(step, bool) and step > resume_step
                and not record.get("superseded")):
            record["superseded"] = True
            line, changed, marked = json.dumps(record, allow_nan=True), True, marked + 1
        lines.append(line)
    if changed:
        write_atomically(path, lambda handle: handle.write("".join(f"{line}\n" for line in lines).encode("utf-8")))
    return marked


def _tensorboard_writer(log_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError("logging.tensorboard = True needs the `tensorboard` package, which is not installed; "
                          "install the extra `pip install moetrain[tensorboard]` or set it to False") from None
    return SummaryWriter(log_dir=str(log_dir))


class ProgressBar:
    """A tqdm bar on rank 0 (when enabled); log lines go above it instead of through it."""

    def __init__(self, total: int, initial: int, enabled: bool):
        self._bar = None
        if enabled:
            self._bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True,
                             mininterval=1.0)

    def update(self, postfix: dict[str, str]) -> None:
        if self._bar is not None:
            self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(1)

    def write(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line)

    @property
    def active(self) -> bool:
        return self._bar is not None

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def format_si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def train_record(*, step: int, result: StepResult, window: list[StepResult], tokens_per_rank_step: int,
                 per_rank_times: list[list[float]], expert_load: torch.Tensor | None, flops_per_token: float,
                 peak_flops: float, tokens_seen: int, skipped_steps: int,
                 all_to_all_per_rank: list[list[float]] | None = None,
                 memory_per_rank: dict[str, list[float]] | None = None,
                 expert_bias: torch.Tensor | None = None) -> dict[str, Any]:
    """The "train" record of a log step.

    `per_rank_times` is every rank's [compute_s, wait_s, step_s]; `expert_load` the step's
    routed assignments per (MoE layer, expert) summed over ranks, or None without MoE layers;
    `all_to_all_per_rank` every rank's [all-to-all seconds, rows sent, rows received] under
    expert parallelism, else None; `memory_per_rank` every rank's peak memory since the previous
    record (`moetrain.observe.peak_memory.PeakMemory`: name -> bytes per rank); `expert_bias` the
    aux-loss-free bias per (MoE layer, expert), or None.
    """
    world = len(per_rank_times)
    global_tokens_per_s = tokens_per_rank_step * world / result.step_s
    record: dict[str, Any] = {
        "kind": "train", "step": step, "loss": result.loss,
        "loss_avg": sum(r.loss for r in window) / len(window), "aux_loss": result.aux_loss,
        "z_loss": result.z_loss,
        "lr": result.lr, "grad_norm": result.grad_norm, "valid_tokens": result.global_tokens,
        "tokens_per_s": global_tokens_per_s,
        "tokens_per_s_per_rank": [tokens_per_rank_step / r[2] for r in per_rank_times],
        "step_s": result.step_s, "compute_s_per_rank": [r[0] for r in per_rank_times],
        "wait_s_per_rank": [r[1] for r in per_rank_times],
        "mfu": flops_per_token * global_tokens_per_s / (peak_flops * world),
        "tokens_seen": tokens_seen, "skipped_steps": skipped_steps,
    }
    if result.mtp_loss is not None:
        record["mtp_loss"] = result.mtp_loss
    if all_to_all_per_rank is not None:
        record["all_to_all_s_per_rank"] = [r[0] for r in all_to_all_per_rank]
        record["all_to_all_rows_sent_per_rank"] = [int(r[1]) for r in all_to_all_per_rank]
        record["all_to_all_rows_received_per_rank"] = [int(r[2]) for r in all_to_all_per_rank]
    if expert_load is not None:
        ratio = (expert_load.max(dim=1).values / expert_load.mean(dim=1).clamp_min(1e-9)).tolist()
        record["expert_load_max_over_mean"] = sum(ratio) / len(ratio)
        record["expert_load_max_over_mean_per_layer"] = ratio
        record.update(expert_health(expert_load, expert_bias))
    if memory_per_rank is not None:
        for name, per_rank in memory_per_rank.items():
            record[f"{name}_bytes_per_rank"] = [int(v) for v in per_rank]
    return record


def expert_health(load: torch.Tensor, bias: torch.Tensor | None = None) -> dict[str, Any]:
    """Per MoE layer: min, max and coefficient of variation of the step's expert load, idle experts, bias range.

    `load` [n_moe_layers, n_experts] counts routed assignments (summed over microbatches and
    ranks); the coefficient of variation is the population standard deviation over the mean
    (0 for perfectly even routing, sqrt(E - 1) when one expert takes everything); an idle
    expert received no token in the step. `bias` (aux-loss-free balancing) gives each
    layer's max - min expert bias, which grows while the bias fights a persistent imbalance.
    """
    load = load.double()
    mean = load.mean(dim=1)
    std = load.std(dim=1, correction=0)
    cv = torch.where(mean > 0, std / mean.clamp_min(1e-300), torch.zeros_like(mean))
    idle = (load == 0).sum(dim=1)
    health: dict[str, Any] = {
        "expert_load_min_per_layer": [int(v) for v in load.min(dim=1).values.tolist()],
        "expert_load_max_per_layer": [int(v) for v in load.max(dim=1).values.tolist()],
        "expert_load_cv_per_layer": cv.tolist(),
        "experts_without_tokens_per_layer": [int(v) for v in idle.tolist()],
        "expert_load_cv": float(cv.mean()),
        "experts_without_tokens": int(idle.sum()),
    }
    if bias is not None:
        bias_range = (bias.double().max(dim=1).values - bias.double().min(dim=1).values).tolist()
        health["expert_bias_range_per_layer"] = bias_range
        health["expert_bias_range"] = max(bias_range)
    return health


def format_bytes(n: float) -> str:
    return f"{n / 2**30:.2f}G" if n >= 2**30 else f"{n / 2**20:.0f}M"


def console_line(record: dict[str, Any], total_steps: int) -> str:
    line = (f"step {record['step']}/{total_steps} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
            f"gnorm {record['grad_norm']:.3f} | {format_si(record['tokens_per_s'])} tok/s | "
            f"step {record['step_s']:.2f}s (compute {max(record['compute_s_per_rank']):.2f}, "
            + (f"all-to-all {max(record['all_to_all_s_per_rank']):.2f}, " if "all_to_all_s_per_rank" in record else "")
            + f"wait {max(record['wait_s_per_rank']):.2f}) | MFU {100 * record['mfu']:.2f}%")
    if "expert_load_max_over_mean" in record:
        line += f" | experts max/mean {record['expert_load_max_over_mean']:.2f}"
        line += f" cv {record['expert_load_cv']:.2f} idle {record['experts_without_tokens']}"
    if "peak_rss_bytes_per_rank" in record:  # the largest over ranks; every rank's value is in the record
        line += f" | peak RSS {format_bytes(max(record['peak_rss_bytes_per_rank']))}"
    if "cuda_max_allocated_bytes_per_rank" in record:
        line += (f" | CUDA max alloc {format_bytes(max(record['cuda_max_allocated_bytes_per_rank']))}"
                 f" reserved {format_bytes(max(record['cuda_max_reserved_bytes_per_rank']))}")
    return line
