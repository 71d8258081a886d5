"""Exit-status stress test: many consecutive multi-rank `torchrun` trainings, counting non-zero exits.

A finished multi-rank run must exit 0 every time, not only most of the time: a rank
that aborts at interpreter exit ("terminate called without an active exception",
SIGABRT) makes torchrun return 1 after the work was done. This script runs the
tiny end-to-end job (a few steps, a checkpoint at the last step) `--runs` times on
each world size in `--world-sizes`, one run at a time, and reports per world size
how many runs exited non-zero and, for those, the lines that say why.

Not part of the test suite (minutes, not seconds). On a shared machine run it alone:
    .venv/bin/python benchmarks/stress/stress_exit.py --runs 50
The counts and the failing runs' last lines go to --out (JSON, rewritten after every run, so
an interrupted stress run still reports what it counted) as well as stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TORCHRUN = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
CORPUS_MODULES = ["bisect.py", "colorsys.py", "keyword.py", "this.py", "stat.py", "glob.py", "fnmatch.py",
                  "genericpath.py", "nturl2path.py", "opcode.py", "copyreg.py", "struct.py"]


def make_corpus(root: Path) -> Path:
    corpus = root / "corpus"
    corpus.mkdir()
    stdlib = Path(os.__file__).parent
    for name in CORPUS_MODULES:
        shutil.copyfile(stdlib / name, corpus / name)
    return corpus


def job_args(corpus: Path, run_dir: Path, steps: int) -> list[str]:
    fields = {
        "model.dim": 32, "model.n_layers": 2, "model.n_heads": 2, "model.ffn_hidden": 64, "model.max_seq_len": 32,
        "model.moe.n_experts": 4, "model.moe.top_k": 2, "model.moe.expert_hidden": 16,
        "data.source": "dir", "data.path": str(corpus), "data.glob": "*.py", "data.seq_len": 32,
        "data.heldout_fraction": 0.2, "train.steps": steps, "train.microbatch_size": 2, "train.warmup_steps": 1,
        "train.eval_every": 0, "train.eval_batches": 2, "train.sample_tokens": 0, "train.num_threads": 1,
        "checkpoint.every": steps, "logging.run_dir": str(run_dir), "logging.log_every": 1,
        "logging.progress_bar": False,
    }
    args = ["--config", str(REPO / "configs" / "tiny_moe.toml")]
    for key, value in fields.items():
        args += [f"--{key}", str(value)]
    return args


def one_run(nproc: int, corpus: Path, run_dir: Path, steps: int, timeout_s: float) -> tuple[int, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    command = [TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), "-m", "moetrain", "train",
               *job_args(corpus, run_dir, steps)]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as err:
        stderr = err.stderr.decode() if isinstance(err.stderr, bytes) else (err.stderr or "")
        return -1, f"timed out after {timeout_s} s\n{stderr[-2000:]}"
    return done.returncode, done.stderr


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50, help="runs per world size")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per run")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "stress_exit.json")
    args = parser.parse_args()
    if TORCHRUN is None:
        print("stress_exit: torchrun is not installed next to this interpreter", file=sys.stderr)
        return 2
    summary: dict[str, object] = {"runs_per_world_size": args.runs, "steps": args.steps, "results": {}}
    with tempfile.TemporaryDirectory(prefix="moetrain-stress-") as tmp:
        corpus = make_corpus(Path(tmp))
        for nproc in args.world_sizes:
            failures = []
            codes: dict[str, int] = {}
            start = time.perf_counter()
            for i in range(args.runs):
                run_dir = Path(tmp) / f"run_{nproc}_{i}"
                code, stderr = one_run(nproc, corpus, run_dir, args.steps, args.timeout_s)
                codes[str(code)] = codes.get(str(code), 0) + 1
                if code != 0:
                    tail = [line for line in stderr.splitlines() if line.strip()][-15:]
                    failures.append({"run": i, "exit": code, "stderr_tail": tail})
                    print(f"world {nproc} run {i}: exit {code}\n  " + "\n  ".join(tail), flush=True)
                shutil.rmtree(run_dir, ignore_errors=True)
                summary["results"][str(nproc)] = {"runs": i + 1, "nonzero": len(failures), "exit_codes": codes,
                                                  "wall_s": round(time.perf_counter() - start, 1),
                                                  "failures": failures}
                write(args.out, summary)
            wall = time.perf_counter() - start
            print(f"world size {nproc}: {len(failures)} of {args.runs} runs exited non-zero "
                  f"(exit codes {codes}; {wall:.0f} s)", flush=True)
    return 0


def write(path: Path, summary: dict[str, object]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
