"""Fault-tolerant HSDP (torchft) under faults and against plain HSDP, with real processes on gloo.

Four measurements, each written to benchmarks/results/ft_<name>.json (and printed):

- `kill`: the suite's kill-and-rejoin scenario, longer and repeated (--repeats): two replica groups
  of 2 ranks, group 1 SIGKILLed early in a step, restarted once group 0 took steps alone. Each
  repeat is checked as the test checks it (before the kill equal to one process, lock-step and
  bitwise-equal weights after the rejoin, every step's loss over the tokens that took part), and
  reports the stall (the kill to group 0's next committed step: failed all-reduce, lighthouse
  heartbeat timeout, new quorum, the step redone) and the rejoin (group 0 released to the
  rejoined group's first step: quorum, the state copied from the peer, the step).
- `lighthouse`: the lighthouse killed while the groups run: the time until both stop (one line,
  a checkpoint each), then a new lighthouse and both groups resumed with --checkpoint.resume auto.
- `overhead`: per-step time of plain HSDP 2 x 2 (one torchrun job of 4 ranks) against the same job
  as two torchft groups of 2 ranks, under each replicate all-reduce policy (delayed_all_reduce: one
  managed all-reduce per step; every_microbatch: one per microbatch), alternating A and B, median
  step time over the last steps, and whether the losses are equal (written as .json and a .md table).

- `layouts`: tensor (tp2), pipeline (pp2) or context (cp2) parallelism inside each of the two groups: losses
  against plain HSDP 2 x (the same layout), then the lighthouse killed and both groups resumed
  (the suite's test runs tp2 only).

Not part of the suite (a minute or more each). On a shared machine the times are noisy: compare
the ratios of one run only.
    PYTHONPATH=src:. .venv/bin/python benchmarks/stress/ft_faults.py kill --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "distributed"))  # the scenario and its checks are the test's own

import test_fault_tolerance as ft_test  # noqa: E402

from moetrain.data.corpus import stdlib_root  # noqa: E402
from moetrain.testing import use_preloaded_fork_server  # noqa: E402
from moetrain.testing.replica_groups import Lighthouse, ReplicaGroupJob, read_records  # noqa: E402

RESULTS = REPO / "benchmarks" / "results"


def _corpus(root: Path) -> Path:
    corpus = root / "corpus"
    corpus.mkdir()
    for name in ft_test.CORPUS:
        (corpus / name).write_bytes((stdlib_root() / name).read_bytes())
    return corpus


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}


def kill(repeats: int, steps: int, keep: Path | None) -> dict:
    runs = []
    for repeat in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tempfile.mkdtemp(dir=keep)) if keep is not None else Path(tmp)
            (root / "run").mkdir()
            print(f"repeat {repeat} in {root}", flush=True)
            result = ft_test.kill_and_rejoin(_corpus(root), root / "run", _env(), steps=steps, kill_after=3,
                                             down_steps=3)
            ft_test.check_kill_and_rejoin(result, steps)
            group0 = ft_test.by_step(result["group0"])
            runs.append({"repeat": repeat, "stall_s": result["stall_s"], "rejoin_s": result["rejoin_s"],
                         "steps_alone": sum(r["ft_participants"] == [0] for r in group0.values()),
                         "redone_steps": max(r["ft_redone_steps"] for r in group0.values()),
                         "median_step_s": statistics.median(r["step_s"] for r in group0.values())})
            print(json.dumps(runs[-1]), flush=True)
    return {"steps": steps, "runs": runs, "checks": "passed"}


def lighthouse_lost(steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus, env = _corpus(root), _env()
        pause = root / "pause"
        pause.write_text("3")
        paused = {**env, "MOETRAIN_TEST_PAUSE_STEPS_FILE": str(pause)}
        light = Lighthouse(env)
        args = lambda g, **more: ft_test.group_args(corpus, root, light.address, g, steps, ft__quorum_timeout_s=5,
                                                   **more)
        groups = [ReplicaGroupJob(root / f"group{g}", args(g), 2, paused) for g in (0, 1)]
        for job in groups:
            job.wait_for(lambda job: job.last_step() >= 2, 120, "step 2")
        light.stop()
        lost_at = time.monotonic()
        pause.unlink()
        codes = [job.wait(120) for job in groups]
        stop_s = time.monotonic() - lost_at
        lines = [[line for line in job.log.read_text().splitlines() if "moetrain: error" in line] for job in groups]
        stopped = [read_records(job.run_dir, "stopped") for job in groups]
        light = Lighthouse(env)
        resumed = [ReplicaGroupJob(root / f"group{g}", args(g, checkpoint__resume="auto"), 2, env) for g in (0, 1)]
        resumed_codes = [job.wait(180) for job in resumed]
        light.stop()
        records = [ft_test.by_step(job.records()) for job in resumed]
        same = all(records[0][s]["param_checksum"] == records[1][s]["param_checksum"]
                   for s in set(records[0]) & set(records[1]))
        return {"exit_codes_when_lost": codes, "stop_s": stop_s, "error_lines": lines, "stopped_records": stopped,
                "resumed_exit_codes": resumed_codes, "resumed_steps": [sorted(r) for r in records],
                "checksums_equal_after_resume": same}


def _median_step_s(run_dir: Path, skip: int) -> float:
    return statistics.median(r["step_s"] for r in read_records(run_dir)[skip:])


LAYOUTS = {"tp2": {"parallel__tp": 2}, "pp2": {"parallel__pp": 2}, "cp2": {"parallel__cp": 2}}


def layouts(steps: int, names: list[str]) -> dict:
    """The suite's lost-lighthouse scenario with each layout inside the two groups, checked as the test checks it."""
    use_preloaded_fork_server()  # the groups' ranks are forked, as in the suite
    runs = {}
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            (root / "run").mkdir()
            started = time.monotonic()
            result = ft_test.layout_and_lost_lighthouse(_corpus(root), root / "run", _env(), steps, 2, LAYOUTS[name])
            ft_test.check_layout_and_lost_lighthouse(result, steps, 2)
            plain = ft_test.by_step(result["plain"])
            resumed = ft_test.by_step(result["resumed"][0])
            first = ft_test.by_step(result["first"][0])
            losses = {**first, **resumed}
            runs[name] = {"wall_s": time.monotonic() - started, "error_line": result["errors"][0][0],
                          "exit_codes_when_lost": result["codes"], "resumed_exit_codes": result["resumed_codes"],
                          "largest_loss_difference_to_plain_hsdp": max(abs(losses[s]["loss"] - plain[s]["loss"])
                                                                       for s in plain),
                          "losses": [losses[s]["loss"] for s in sorted(losses)], "checks": "passed"}
            print(name, json.dumps({k: v for k, v in runs[name].items() if k != "losses"}), flush=True)
    return {"steps": steps, "lighthouse_lost_after_step": 2, "layouts": runs}


POLICIES = ("delayed_all_reduce", "every_microbatch")


def _plain_hsdp(root: Path, corpus: Path, env: dict[str, str], steps: int, policy: str, tag: str) -> dict:
    run_dir = root / f"hsdp_{policy}_{tag}"
    job = ReplicaGroupJob(run_dir, ft_test.job_args(
        corpus, run_dir, train__steps=steps, parallel__dp_replicate=2, parallel__dp_shard=2,
        parallel__sync_policy=policy, checkpoint__enabled=False), 4, env)
    assert job.wait(600) == 0, job.log.read_text()[-2000:]
    return {"what": "plain HSDP 2x2", "policy": policy, "step_s": _median_step_s(run_dir, 3),
            "losses": [r["loss"] for r in read_records(run_dir)]}


def _torchft(root: Path, corpus: Path, env: dict[str, str], steps: int, policy: str, tag: str) -> dict:
    light = Lighthouse(env, min_replicas=2)
    sub = root / f"ft_{policy}_{tag}"
    groups = [ReplicaGroupJob(sub / f"group{g}", ft_test.group_args(
        corpus, sub, light.address, g, steps, checkpoint__enabled=False, parallel__sync_policy=policy), 2, env)
        for g in (0, 1)]
    assert [job.wait(600) for job in groups] == [0, 0], groups[0].log.read_text()[-2000:]
    light.stop()
    return {"what": "torchft 2 groups x 2 ranks", "policy": policy, "step_s": _median_step_s(sub / "group0", 3),
            "losses": [r["loss"] for r in read_records(sub / "group0")]}


def overhead(steps: int, pairs: int) -> dict:
    """Per policy, plain HSDP 2 x 2 and torchft 2 x 2 in turn (A B A B ...), median step of steps 4.. each."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus, env = _corpus(root), _env()
        for pair in range(pairs):
            for policy in POLICIES:
                for run in (_plain_hsdp, _torchft):
                    rows.append({"pair": pair, **run(root, corpus, env, steps, policy, str(pair))})
                    print(json.dumps({k: v for k, v in rows[-1].items() if k != "losses"}), flush=True)
    summary = {}
    for policy in POLICIES:
        hsdp = [r for r in rows if r["policy"] == policy and r["what"].startswith("plain")]
        torchft = [r for r in rows if r["policy"] == policy and r["what"].startswith("torchft")]
        summary[policy] = {
            "torchft_over_hsdp": [b["step_s"] / a["step_s"] for a, b in zip(hsdp, torchft, strict=True)],
            "largest_loss_difference": max(abs(x - y) for a, b in zip(hsdp, torchft, strict=True)
                                           for x, y in zip(a["losses"], b["losses"], strict=True)),
            "losses_bitwise_equal": all(a["losses"] == b["losses"] for a, b in zip(hsdp, torchft, strict=True))}
    return {"steps": steps, "rows": rows, "by_policy": summary}


def overhead_table(result: dict) -> str:
    """The overhead run as a markdown table: one line per pair and policy."""
    lines = ["| pair | policy | plain HSDP 2x2 | torchft 2 groups x 2 | torchft / HSDP | losses |",
             "|---|---|---|---|---|---|"]
    for policy in result["by_policy"]:
        rows = [r for r in result["rows"] if r["policy"] == policy]
        for pair in sorted({r["pair"] for r in rows}):
            hsdp, ft = (next(r for r in rows if r["pair"] == pair and r["what"].startswith(w))
                        for w in ("plain", "torchft"))
            same = "bitwise equal" if hsdp["losses"] == ft["losses"] else (
                f"max diff {max(abs(x - y) for x, y in zip(hsdp['losses'], ft['losses'], strict=True)):.1e}")
            lines.append(f"| {pair} | {policy} | {hsdp['step_s']:.3f} s | {ft['step_s']:.3f} s | "
                         f"{ft['step_s'] / hsdp['step_s']:.2f} | {same} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("kill", "lighthouse", "overhead", "layouts"))
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--keep", type=Path, default=None, help="kill: keep each repeat's directories under this one")
    parser.add_argument("--out", default=None, help="file name under benchmarks/results (default ft_WHAT.json)")
    args = parser.parse_args()
    result = {"kill": lambda: kill(args.repeats, args.steps, args.keep),
              "lighthouse": lambda: lighthouse_lost(args.steps),
              "overhead": lambda: overhead(args.steps, args.pairs),
              "layouts": lambda: layouts(args.steps, args.layouts)}[args.what]()
    result["machine"] = f"{os.cpu_count()} CPUs, shared with other jobs: compare ratios of one run only"
    out = RESULTS / (args.out or f"ft_{args.what}.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    if args.what == "overhead":
        table = overhead_table(result)
        out.with_suffix(".md").write_text(table)
        print(table)
    print(json.dumps({k: v for k, v in result.items() if k not in ("rows", "runs", "layouts")}, indent=2))


if __name__ == "__main__":
    main()
