"""Training metrics: JSONL records, the rank-0 progress bar, optional TensorBoard, and `moetrain plot`.

The trainer computes the numbers; this module only formats, stores and draws them.
Records are one JSON object per line in `RUN_DIR/metrics.jsonl`, with a `kind` of
"train" (every log step), "eval" (held-out loss / bits per byte), "event" (start,
resume, skipped step) or "final". A resumed run appends to the same file, so a step
can appear twice (once before an interruption, once after); readers keep the last
record per (kind, step), which is the one that led to the final model.
"""

from __future__ import annotations

import argparse
import json
import math
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from moetrain.config import ConfigError

METRICS_FILE = "metrics.jsonl"
LN2 = math.log(2.0)


def bits_per_byte(loss_sum_nats: float, n_bytes: int) -> float:
    """Total cross-entropy (nats) over the text's UTF-8 byte count, in bits."""
    return loss_sum_nats / (LN2 * n_bytes) if n_bytes > 0 else float("nan")


def unigram_entropy_bits(byte_counts: Counter[int] | dict[int, int]) -> float:
    """Entropy (bits per byte) of the empirical byte distribution: the best any unigram model can do."""
    total = sum(byte_counts.values())
    return -sum(c / total * math.log2(c / total) for c in byte_counts.values() if c > 0)


def byte_histogram(texts: Iterable[str]) -> Counter[int]:
    counts: Counter[int] = Counter()
    for text in texts:
        counts.update(text.encode("utf-8"))
    return counts


class MetricsWriter:
    """Appends records to RUN_DIR/metrics.jsonl (and TensorBoard when asked); a no-op off rank 0."""

    def __init__(self, run_dir: str | Path, enabled: bool, tensorboard: bool = False):
        self.enabled = enabled
        self.path = Path(run_dir) / METRICS_FILE
        self._tb = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if tensorboard:
                self._tb = _tensorboard_writer(Path(run_dir) / "tensorboard")

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as fh:
            fh.write(json.dumps(record, allow_nan=True) + "\n")
        if self._tb is not None and "step" in record:
            for key, value in record.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                    self._tb.add_scalar(f"{record.get('kind', 'train')}/{key}", value, record["step"])

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


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
            from tqdm import tqdm

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


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """All records of a metrics file; the last one wins for a repeated (kind, step)."""
    latest: dict[tuple[str, Any], dict[str, Any]] = {}
    order: list[tuple[str, Any]] = []
    lines = Path(path).read_text().splitlines()
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            # A run killed mid-write can leave a truncated last line; anything else is a real problem.
            if line_no == len(lines):
                continue
            raise ConfigError(f"{path}:{line_no} is not a JSON record") from None
        key = (record.get("kind", ""), record.get("step", line_no) if record.get("kind") != "event" else line_no)
        if key not in latest:
            order.append(key)
        latest[key] = record
    return [latest[k] for k in order]


def series(records: list[dict[str, Any]], kind: str, key: str) -> tuple[list[int], list[float]]:
    rows = sorted((r["step"], r[key]) for r in records if r.get("kind") == kind and key in r
                  and isinstance(r.get(key), (int, float)) and math.isfinite(r[key]))
    return [s for s, _ in rows], [v for _, v in rows]


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw loss (train, held-out), held-out bits per byte and throughput against step to a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise ConfigError(f"run directory {str(run_dir)!r} has no {METRICS_FILE}; pass the logging.run_dir "
                          "of a training run")
    records = read_records(path)
    train_steps, train_loss = series(records, "train", "loss")
    if not train_steps:
        raise ConfigError(f"{path} has no training records yet")
    eval_steps, eval_loss = series(records, "eval", "heldout_loss")
    _, eval_bpb = series(records, "eval", "heldout_bpb")
    tput_steps, tput = series(records, "train", "tokens_per_s")
    final = next((r for r in reversed(records) if r.get("kind") == "final"), {})

    _, train_avg = series(records, "train", "loss_avg")
    entropy = final.get("unigram_entropy_bits")
    fig, (ax_loss, ax_bpb, ax_tput) = plt.subplots(1, 3, figsize=(15, 4.2))
    ax_loss.plot(train_steps, train_loss, color="tab:blue", alpha=0.35, linewidth=0.8, label="train loss (log step)")
    if len(train_avg) == len(train_steps):
        ax_loss.plot(train_steps, train_avg, color="tab:blue", label="train loss (mean since last log)")
    if eval_steps:
        ax_loss.plot(eval_steps, eval_loss, "o-", color="tab:orange", label="held-out loss")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("cross-entropy (nats per token)")
    ax_loss.set_title("loss")
    ax_loss.legend(loc="upper right")
    if eval_steps:
        ax_bpb.plot(eval_steps, eval_bpb, "o-", color="tab:green", label="held-out bits per byte")
    if entropy is not None:
        ax_bpb.axhline(entropy, color="gray", linestyle=":", label=f"unigram byte entropy ({entropy:.2f})")
    ax_bpb.set_xlabel("step")
    ax_bpb.set_ylabel("bits per byte")
    ax_bpb.set_title("held-out bits per byte")
    ax_bpb.set_ylim(bottom=0)
    if eval_steps or entropy is not None:
        ax_bpb.legend(loc="lower left")
    ax_tput.plot(tput_steps, tput, color="tab:purple")
    ax_tput.set_xlabel("step")
    ax_tput.set_ylabel("tokens / s (global)")
    ax_tput.set_title("throughput")
    ax_tput.set_ylim(bottom=0)
    fig.suptitle(f"moetrain run {run_dir.name}")
    fig.tight_layout()
    out_path = Path(out) if out is not None else run_dir / "training_curve.png"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path


def plot_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="moetrain plot", description="Draw a run's loss and throughput curves.")
    parser.add_argument("run_dir", help="the run directory (logging.run_dir of the training job)")
    parser.add_argument("--out", default=None, help="PNG path (default RUN_DIR/training_curve.png)")
    args = parser.parse_args(argv)
    print(plot_run(args.run_dir, args.out))
    return 0
