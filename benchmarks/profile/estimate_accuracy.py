"""Is `moetrain estimate`'s CPU peak within 15% of the peak RSS a real run reaches? One row per preset.

    .venv/bin/python benchmarks/profile/estimate_accuracy.py \
        [--steps=3] [--only=NAME[,NAME]] [--json=benchmarks/results/estimate_accuracy.json] [--from=JSON]

For each case (a config, overrides, a world size) it trains a few steps in a subprocess exactly
as a user would (`python -m moetrain train ...`, under `torchrun --standalone --nproc-per-node N`
for N > 1 ranks), reads every rank's lifetime peak RSS (`resource.getrusage(RUSAGE_SELF).ru_maxrss`
at the end of that rank, written by the thin wrapper `--child` below) and compares it with the
peak `moetrain estimate` reports for the same config and world size (its own subprocess, so its
process baseline is measured in a fresh interpreter, as a user's `moetrain estimate` would).

Measurement notes: the run's per-window peak records reset the kernel's RSS high-water mark
(/proc/self/clear_refs), which would also reset ru_maxrss; the wrapper points that reset at a
missing file so the record falls back to the lifetime peak, which changes no allocation of the
run. Evaluation, the sample and checkpoints are off (the estimate is of training; evaluation
runs without gradients and stays below it). Timings on a shared machine are not the point here:
only memory is compared. The two qwen3_moe_debug FSDP cases need about 7 GB free.
Writes JSON and a table beside it (same name, .txt). `--from=JSON` keeps
the runs measured in that file and computes the estimates again with the current code.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 0.15
TRAIN_OFF = ["--train.warmup_steps", "1", "--train.eval_every", "0", "--train.sample_tokens", "0",
             "--checkpoint.enabled", "False", "--logging.log_every", "1", "--logging.progress_bar", "False"]
# (name, config, overrides, world, environment): the presets that train on CPU in a few steps, and FSDP over
# 2 ranks, those also with torch's huge-page allocation off (moetrain.runtime.allocator turns it on for
# every rank of a multi-rank job; a value in the environment wins).
NO_HUGE_PAGES = {"THP_MEM_ALLOC_ENABLE": "0"}
CASES = [
    ("tiny_moe", "configs/tiny_moe.toml", [], 1, {}),
    ("tiny_moe_ac", "configs/tiny_moe.toml", ["--train.activation_checkpointing", "True"], 1, {}),
    ("olmoe_tiny", "configs/olmoe_tiny.toml", [], 1, {}),
    ("qwen3_moe_debug", "configs/qwen3_moe_debug.toml", [], 1, {}),
    ("tiny_moe_fsdp2", "configs/tiny_moe.toml", [], 2, {}),
    ("tiny_moe_fsdp2_no_thp", "configs/tiny_moe.toml", [], 2, NO_HUGE_PAGES),
    ("qwen3_moe_debug_fsdp2", "configs/qwen3_moe_debug.toml", ["--data.seq_len", "128"], 2, {}),
    ("qwen3_moe_debug_fsdp2_no_thp", "configs/qwen3_moe_debug.toml", ["--data.seq_len", "128"], 2, NO_HUGE_PAGES),
    # expert parallelism: half or a quarter of the experts per rank, tokens exchanged by all-to-all
    ("tiny_moe_ep2", "configs/tiny_moe.toml", ["--parallel.ep", "2"], 2, {}),
    ("tiny_moe_ep2_no_thp", "configs/tiny_moe.toml", ["--parallel.ep", "2"], 2, NO_HUGE_PAGES),
    ("tiny_moe_ep2_of4_no_thp", "configs/tiny_moe.toml", ["--parallel.ep", "2"], 4, NO_HUGE_PAGES),
    ("tiny_moe_ep4_no_thp", "configs/tiny_moe.toml", ["--parallel.ep", "4"], 4, NO_HUGE_PAGES),
]


def child(argv: list[str]) -> None:
    """One rank: `moetrain train ARGS` as `python -m moetrain` runs it, then this rank's lifetime peak RSS."""
    out_dir, args = Path(argv[0]), argv[1:]
    from moetrain.runtime.allocator import huge_pages_for_large_tensors

    huge_pages_for_large_tensors()  # as moetrain.cli.entry does, before torch loads
    from moetrain import cli
    from moetrain.observe import peak_memory

    peak_memory._CLEAR_REFS = Path("/nonexistent/clear_refs")  # keep the lifetime high-water mark
    code = cli.main(["train", *args])
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    rank = int(os.environ.get("RANK", "0"))
    (out_dir / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "code": code,
                                                           "peak_rss_bytes": peak_kib * 1024}))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as moetrain.cli.entry ends a rank of a multi-rank job


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return env


def measure(config: str, overrides: list[str], world: int, steps: int, environment: dict[str, str]) -> dict:
    """Train `steps` steps on `world` ranks; every rank's peak RSS and the wall time."""
    with tempfile.TemporaryDirectory() as tmp:
        args = ["--config", config, *overrides, "--train.steps", str(steps), *TRAIN_OFF,
                "--logging.run_dir", str(Path(tmp) / "run")]
        script = [str(Path(__file__).resolve()), "--child", tmp, *args]
        if world == 1:
            command = [sys.executable, *script]
        else:
            torchrun = str(Path(sys.executable).with_name("torchrun"))
            command = [torchrun, "--standalone", "--nproc-per-node", str(world), *script]
        start = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, env=_env(environment), capture_output=True, text=True,
                              timeout=3600)
        wall_s = time.perf_counter() - start
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(world)]
        records = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    # Every rank's resident memory at the end of each step: whether the peak has settled by the last step.
    rss_per_step = [r["rss_bytes_per_rank"] for r in sorted((r for r in records if r["kind"] == "train"),
                                                             key=lambda r: r["step"])]
    return {"peak_rss_bytes_per_rank": [r["peak_rss_bytes"] for r in ranks], "wall_s": wall_s,
            "rss_bytes_per_rank_per_step": rss_per_step}


def estimated(config: str, overrides: list[str], world: int) -> dict:
    """`moetrain estimate --json` for the same job and world size, in a fresh interpreter."""
    command = [sys.executable, "-m", "moetrain", "estimate", "--config", config, *overrides, "--world", str(world),
               "--json"]
    done = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600, check=True)
    return json.loads(done.stdout)


def _write(json_path: Path, steps: int, rows: list[dict]) -> None:
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({"steps": steps, "cases": rows}, indent=1) + "\n")


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        child(argv[1:])
    options = dict(re.fullmatch(r"--(\w+)=(.*)", a).groups() for a in argv if re.fullmatch(r"--(\w+)=(.*)", a))
    steps = int(options.get("steps", "3"))
    only = set(options["only"].split(",")) if "only" in options else None
    json_path = Path(options.get("json", ROOT / "benchmarks" / "results" / "estimate_accuracy.json"))
    # --from=JSON: the runs measured there, the estimates computed again by the current code (no training).
    earlier = {row["name"]: row for row in json.loads(Path(options["from"]).read_text())["cases"]} \
        if "from" in options else None
    rows = []
    for name, config, overrides, world, environment in CASES:
        if (only is not None and name not in only) or (earlier is not None and name not in earlier):
            continue
        estimate = estimated(config, overrides, world)
        if earlier is not None:
            run = {key: earlier[name][key] for key in ("peak_rss_bytes_per_rank", "wall_s",
                                                       "rss_bytes_per_rank_per_step")}
            steps = earlier[name]["steps"]
        else:
            try:
                run = measure(config, overrides, world, steps, environment)
            except (RuntimeError, subprocess.TimeoutExpired) as err:  # e.g. killed for memory on a shared host
                print(f"{name}: no measurement: {str(err)[:300]}", flush=True)
                continue
        measured = max(run["peak_rss_bytes_per_rank"])
        peak = estimate["peak_bytes"]
        rows.append({"name": name, "config": config, "overrides": overrides, "world": world, "steps": steps,
                     "environment": environment,
                     "measured_peak_rss_bytes": measured, **run, "estimate": estimate,
                     "estimated_peak_bytes": peak, "error": peak / measured - 1})
        print(f"{name}: estimated {peak / 2**20:.0f} MiB, measured {measured / 2**20:.0f} MiB "
              f"({100 * (peak / measured - 1):+.1f}%)", flush=True)
        _write(json_path, steps, rows)  # after every case: a later one may not finish
    lines = [f"{'case':<24} {'ranks':>5} {'estimate MiB':>12} {'measured MiB':>12} {'error':>7}  within 15%"]
    for row in rows:
        lines.append(f"{row['name']:<24} {row['world']:>5} {row['estimated_peak_bytes'] / 2**20:>12.0f} "
                     f"{row['measured_peak_rss_bytes'] / 2**20:>12.0f} {100 * row['error']:>+6.1f}%  "
                     f"{'yes' if abs(row['error']) <= TOLERANCE else 'NO'}")
    print("\n".join(lines))
    _write(json_path, steps, rows)
    json_path.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    return 0 if all(abs(row["error"]) <= TOLERANCE for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
