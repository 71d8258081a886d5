"""Peak RSS and step time of LoRA (rank 16, every target the model has) against full fine-tuning, side by side.

    PYTHONPATH=$PWD/src:$PWD python benchmarks/profile/lora_memory.py --out benchmarks/results/lora_memory \
        [--rounds 2] [--dtype float32] [--seq-len 128] [--steps 2]

qwen3_moe_debug (every layer MoE, no shared expert, no dense layer: the targets are attention, experts and
router), one process, one microbatch of `--batch` x `--seq-len` tokens, one thread, `--warmup` + `--steps`
steps of `moetrain bench train`. Each run is a fresh process (its peak RSS is its own high-water mark),
and the order alternates full / LoRA, LoRA / full across rounds, so drift on a shared machine hits both
alike. Writes OUT.json (every run and the medians) and prints the ratios LoRA / full. The frozen base is
stored in the compute dtype (`--dtype`), so in float32 the saving is the gradients and AdamW's moments
of the base; in bfloat16 the float32 master weights go too. A benchmark: asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

LORA = ["--lora.rank", "16", "--lora.targets", "attention", "experts", "router"]


def one_run(lora: bool, args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "bench.json"
        command = [sys.executable, "-m", "moetrain", "bench", "train", "--config", "configs/qwen3_moe_debug.toml",
                   "--data.seq_len", str(args.seq_len), "--train.microbatch_size", str(args.batch),
                   "--train.grad_accum", "1", "--data.max_documents", "300", "--train.num_threads", "1",
                   "--parallel.param_dtype", args.dtype, "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--json", str(report), *(LORA if lora else [])]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        result = json.loads(report.read_text())
    return {"lora": lora, "peak_rss_bytes": max(m["peak_rss_bytes"] for m in result["memory_per_rank"]),
            "step_s_median": result["step_s_median"], "tokens_per_s": result["tokens_per_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    runs = []
    for round_ in range(args.rounds):
        for lora in ((False, True) if round_ % 2 == 0 else (True, False)):
            runs.append({"round": round_, **one_run(lora, args)})
            print(runs[-1], flush=True)
    medians = {}
    for key in ("peak_rss_bytes", "step_s_median", "tokens_per_s"):
        full = statistics.median(r[key] for r in runs if not r["lora"])
        lora = statistics.median(r[key] for r in runs if r["lora"])
        medians[key] = {"full": full, "lora": lora, "lora_over_full": lora / full}
    summary = {"config": vars(args) | {"out": str(args.out)}, "lora_args": LORA, "runs": runs, "medians": medians}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    for key, value in medians.items():
        print(f"{key:16} full {value['full']:.4g}  LoRA {value['lora']:.4g}  LoRA/full {value['lora_over_full']:.3f}")


if __name__ == "__main__":
    main()
