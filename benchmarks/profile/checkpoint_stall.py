"""How long a checkpoint save blocks the training loop: synchronous against `checkpoint.async_save`, side by side.

    PYTHONPATH=src .venv/bin/python benchmarks/profile/checkpoint_stall.py [--rounds 3] [--steps 8] [--threads 1]

One process, the Qwen3-MoE debug architecture (`configs/qwen3_moe_debug.toml`) cut to 2 layers of
16 experts so that its state (weights and both AdamW moments) is a few hundred MB, trained on
1 x 128 random tokens a step. Each round runs, in an order that alternates from round to round,
three legs of the same `--steps` training steps: "none" (no save), "sync" and "async" (a save of
`Checkpointer.maybe_save` requested before the steps, waited for after them). Per leg:

- stall_s: the time `maybe_save` blocked the loop (sync: the whole save; async: gathering the small
  state and copying the tensors into the staging buffers, plus any wait at the end for a write not
  yet done);
- leg_s - none_s: what the save cost the loop in all, including a background write's contention
  with the steps it overlaps (on a CPU the write shares the cores with training);
- background_s (async): how long the write, hashing, manifest and rename took in its thread.

A fourth leg, "probe", requests an async save and, instead of training, spins a pure-Python loop
until the write is done, recording the gaps between its iterations: the longest gap and the sum
of gaps over 20 ms are the time the background save kept the loop's thread from running at all
(the GIL: parts of DCP's safetensors serialization hold it), which `stall_s` does not see. The
same probe without a save ("probe_idle", as long) is the floor the shared machine's scheduler sets.

The first round warms the staging buffers and the page cache and is dropped. Reports medians and
their ratios (async / sync) and writes benchmarks/results/checkpoint_stall.json.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from moetrain.args import take_option
from moetrain.checkpoint.checkpointer import Checkpointer
from moetrain.checkpoint.state import capture_rng_state
from moetrain.checkpoint.storage import tensor_state
from moetrain.config.checkpoint import CheckpointConfig
from moetrain.config.job import load
from moetrain.model.transformer import Transformer

TOKENS = 128


class _State:
    """What the Checkpointer saves of a trainer: model, optimizer, config, and the small state."""

    def __init__(self, cfg):
        self.cfg = cfg
        torch.manual_seed(0)
        self.model = Transformer(cfg.model)
        self.model.init_weights(seed=0)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.steps = 0

    def trainer_state(self):
        return {"skipped_steps": 0, "tokens_seen": self.steps * TOKENS, "seed": 0}

    def per_rank_state(self):
        return {"loader": {"cursor": self.steps, "seed": 0}, "rng": capture_rng_state()}

    def train_step(self) -> None:
        tokens = torch.randint(0, self.cfg.model.vocab_size, (1, TOKENS))
        self.model(tokens).float().square().mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1


def _leg(state: _State, saver: Checkpointer | None, steps: int) -> dict[str, float]:
    start = time.perf_counter()
    stall = 0.0
    pending = None
    if saver is not None:
        saver.maybe_save(state.steps + 1, state, force=True)
        stall = time.perf_counter() - start
        pending = saver._in_flight
    step_times = []
    for _ in range(steps):
        t = time.perf_counter()
        state.train_step()
        step_times.append(time.perf_counter() - t)
    if saver is not None:
        t = time.perf_counter()
        saver.wait()
        stall += time.perf_counter() - t
    row = {"leg_s": time.perf_counter() - start, "stall_s": stall, "step_s_median": statistics.median(step_times)}
    if pending is not None and pending.finished is not None:
        row["background_s"] = pending.finished - pending.started
    return row


GAP_S = 0.02


def _spin(until) -> dict[str, float]:
    """Spin until `until()`; the longest gap between iterations and the sum of gaps over GAP_S."""
    start = last = time.perf_counter()
    longest = held = 0.0
    while not until():
        now = time.perf_counter()
        gap = now - last
        longest = max(longest, gap)
        held += gap if gap > GAP_S else 0.0
        last = now
    return {"leg_s": time.perf_counter() - start, "longest_gap_s": longest, "gaps_over_20ms_s": held}


def _probe(state: _State, saver: Checkpointer) -> tuple[dict[str, float], dict[str, float]]:
    start = time.perf_counter()
    saver.maybe_save(state.steps + 1, state, force=True)
    stall = time.perf_counter() - start
    pending = saver._in_flight
    row = {**_spin(pending.done), "stall_s": stall}
    saver.wait()
    duration = row["leg_s"]
    idle_until = time.perf_counter() + duration
    return row, _spin(lambda: time.perf_counter() >= idle_until)


def main() -> int:
    argv = sys.argv[1:]
    rounds, argv = take_option(argv, "rounds")
    steps, argv = take_option(argv, "steps")
    threads, argv = take_option(argv, "threads")
    rounds, steps = int(rounds or 3), int(steps or 8)
    torch.set_num_threads(int(threads or 1))
    cfg = load("configs/qwen3_moe_debug.toml")
    cfg = replace(cfg, model=replace(cfg.model, n_layers=2, max_seq_len=TOKENS,
                                     moe=replace(cfg.model.moe, n_experts=16, aux_loss_scope="microbatch")))
    state = _State(cfg)
    state.train_step()  # the moments exist
    state_bytes = sum(t.numel() * t.element_size() for t in tensor_state(state.model, state.optimizer)["model"]
                      .values()) * 3
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        savers = {mode: Checkpointer(Path(tmp) / mode, CheckpointConfig(every=10**9, keep_last=1,
                                                                         async_save=mode == "async"),
                                     10**9, "bench") for mode in ("sync", "async")}
        for r in range(rounds + 1):  # round 0 warms up and is dropped
            order = ["none", "sync", "async"] if r % 2 == 0 else ["async", "sync", "none"]
            for mode in order:
                row = _leg(state, savers.get(mode), steps)
                rows.append({"round": r, "mode": mode, **row})
                print(f"round {r} {mode:5s} leg {row['leg_s']:.2f} s, stall {row['stall_s']:.3f} s"
                      + (f", background {row['background_s']:.2f} s" if "background_s" in row else ""), flush=True)
            probe, idle = _probe(state, savers["async"])
            rows += [{"round": r, "mode": "probe", **probe}, {"round": r, "mode": "probe_idle", **idle}]
            print(f"round {r} probe: longest gap {probe['longest_gap_s']:.3f} s, gaps > 20 ms "
                  f"{probe['gaps_over_20ms_s']:.3f} s; idle: {idle['longest_gap_s']:.3f} s, "
                  f"{idle['gaps_over_20ms_s']:.3f} s", flush=True)
        checkpoint_bytes = sum(p.stat().st_size for p in (Path(tmp) / "sync").rglob("*") if p.is_file())
        for saver in savers.values():
            saver.close()
    kept = [row for row in rows if row["round"] > 0]

    def med(mode: str, key: str) -> float:
        return statistics.median(row[key] for row in kept if row["mode"] == mode)

    none_s = {r: next(row["leg_s"] for row in kept if row["round"] == r and row["mode"] == "none")
              for r in range(1, rounds + 1)}
    cost = {mode: statistics.median(row["leg_s"] - none_s[row["round"]] for row in kept if row["mode"] == mode)
            for mode in ("sync", "async")}
    result = {
        "model": "qwen3_moe_debug, 2 layers, 16 experts", "state_bytes": state_bytes,
        "checkpoint_bytes": checkpoint_bytes, "tokens_per_step": TOKENS, "steps_per_leg": steps, "rounds": rounds,
        "intra_op_threads": torch.get_num_threads(), "torch": torch.__version__, "machine": platform.machine(),
        "note": "shared 2-core machine (other jobs running): compare the ratios, not the seconds",
        "stall_s_median": {mode: med(mode, "stall_s") for mode in ("sync", "async")},
        "stall_async_over_sync": med("async", "stall_s") / med("sync", "stall_s"),
        "save_cost_s_median": cost,
        "save_cost_async_over_sync": cost["async"] / cost["sync"] if cost["sync"] > 0 else None,
        "background_s_median": med("async", "background_s"),
        "step_s_median": {mode: med(mode, "step_s_median") for mode in ("none", "sync", "async")},
        "loop_thread_held_off_s_median": {mode: {key: med(mode, key) for key in ("longest_gap_s", "gaps_over_20ms_s")}
                                          for mode in ("probe", "probe_idle")},
        "rows": rows,
    }
    print(f"state {state_bytes / 2**20:.0f} MiB, checkpoint {checkpoint_bytes / 2**20:.0f} MiB, {rounds} rounds of "
          f"{steps} steps: the loop blocked per save: sync {result['stall_s_median']['sync']:.3f} s, async "
          f"{result['stall_s_median']['async']:.3f} s (async/sync {result['stall_async_over_sync']:.3f}); "
          f"all it cost the loop: sync {cost['sync']:.2f} s, async {cost['async']:.2f} s; background write "
          f"{result['background_s_median']:.2f} s; the loop's thread held off during a background write: "
          f"longest {result['loop_thread_held_off_s_median']['probe']['longest_gap_s']:.3f} s, in all "
          f"{result['loop_thread_held_off_s_median']['probe']['gaps_over_20ms_s']:.3f} s (no save: "
          f"{result['loop_thread_held_off_s_median']['probe_idle']['gaps_over_20ms_s']:.3f} s)")
    out = Path("benchmarks/results/checkpoint_stall.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
