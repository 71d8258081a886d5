"""Generation speed: the KV cache against re-running the context for every token, side by side on one model.

Builds the default job's model (configs/tiny_moe.toml, freshly initialised: speed does not depend on
the weights) and generates `--tokens` new tokens greedily after the prompt "def " (no EOS stop, so
every run makes exactly that many), alternating the two paths A B B A ... for `--rounds` rounds in
this one process: A = `use_cache=False` (each new token reruns the whole context: what `moetrain
sample` did before the cache), B = the KV cache. Both must produce the same tokens; the JSON holds
every timing, the medians and the speed-up (median A / median B).

On a loaded machine the wall times above mix in other jobs' load, so `--min-of N` (batch 1) also
times single forwards, the minimum of N tries each: the full forward of a context of L tokens (what
path A runs per new token) and one cached one-token step after L - 1 cached tokens (path B), at
five context lengths across the generation; the ratio of their means estimates the speed-up on an
idle core.

    .venv/bin/python benchmarks/profile/generation_speed.py \
        --out benchmarks/results/generation_speed.json

`--profile N` also records where one cached decode step (batch 1, context 100) spends its time:
torch.profiler over N steps, the top operators by self CPU time per step, the operator count per
step and the minimum step time (wall and this thread's CPU time); `--profile-only` writes just
that (e.g. against an older tree, for a before/after comparison).

Benchmark only: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from moetrain.config.job import load
from moetrain.data.tokenizer import build_tokenizer
from moetrain.evaluate.generate import generate_tokens
from moetrain.model.kv_cache import KVCache
from moetrain.train.build import build_model

HERE = Path(__file__).resolve().parents[2]


def _minimum(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@torch.no_grad()
def per_forward_minimum(model, prompt: list[int], new_tokens: int, repeats: int, device: str) -> dict:
    """Minimum seconds of one path-A forward and one path-B step at context lengths across the generation."""
    model.eval()
    rows = []
    for step in (0, new_tokens // 4, new_tokens // 2, 3 * new_tokens // 4, new_tokens - 1):
        context = torch.tensor([(prompt * new_tokens)[:len(prompt) + step]], device=device)
        full = _minimum(lambda context=context: model(context), repeats)
        cache = KVCache(len(model.layers), 1, context.shape[1])
        model(context[:, :-1], cache=cache)
        filled = cache.length

        def cached_step(cache=cache, filled=filled, last=context[:, -1:]):
            cache.length = filled  # rewind: the same step again
            model(last, cache=cache)

        rows.append({"context": context.shape[1], "full_forward_s": full,
                     "cached_step_s": _minimum(cached_step, repeats)})
    mean_full = statistics.mean(r["full_forward_s"] for r in rows)
    mean_cached = statistics.mean(r["cached_step_s"] for r in rows)
    return {"rows": rows, "estimated_speedup": mean_full / mean_cached}


@torch.no_grad()
def decode_step_profile(model, steps: int, context: int = 100, top: int = 15) -> dict:
    """Top operators (self CPU time per step) of one cached one-token step after `context` cached tokens."""
    from torch.profiler import ProfilerActivity, profile

    model.eval()
    tokens = torch.randint(3, 250, (1, context + 1), generator=torch.Generator().manual_seed(0))
    cache = KVCache(len(model.layers), 1, context + 1)
    model(tokens[:, :-1], cache=cache)

    def step():
        cache.length = context  # rewind: the same step again
        model(tokens[:, -1:], cache=cache)

    for _ in range(10):
        step()
    wall, cpu = [], []
    for _ in range(max(steps, 20)):
        start, cpu_start = time.perf_counter(), time.thread_time()
        step()
        wall.append(time.perf_counter() - start)
        cpu.append(time.thread_time() - cpu_start)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total_us = sum(e.self_cpu_time_total for e in rows) / steps
    return {
        "context": context, "profiled_steps": steps, "threads": torch.get_num_threads(),
        "step_min_wall_ms": 1e3 * min(wall), "step_min_cpu_ms": 1e3 * min(cpu),
        "step_median_cpu_ms": 1e3 * statistics.median(cpu),
        "operator_calls_per_step": sum(e.count for e in rows) / steps,
        "profiled_self_cpu_us_per_step": total_us,
        "top_ops": [{"name": e.key, "calls_per_step": e.count / steps, "self_cpu_us_per_step": e.self_cpu_time_total
                     / steps, "share": e.self_cpu_time_total / steps / total_us} for e in rows[:top]],
        "note": "profiler times include its own per-operator overhead; compare shares and counts",
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=str(HERE / "configs" / "tiny_moe.toml"))
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1, help="prompts generated together")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--min-of", type=int, default=0, help="also time single forwards, min of N (batch 1)")
    parser.add_argument("--profile", type=int, default=0, help="also profile N cached decode steps (batch 1)")
    parser.add_argument("--profile-only", action="store_true", help="write only the decode-step profile")
    parser.add_argument("--out", default=str(HERE / "benchmarks" / "results" / "generation_speed.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load(args.config)
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    model = build_model(cfg.model, device=args.device, seed=0).eval()
    if args.profile_only:
        profile = decode_step_profile(model, max(args.profile, 20))
        profile.update(torch=torch.__version__, load_average_1_5_15_min=os.getloadavg())
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(profile, indent=2) + "\n")
        print(json.dumps({k: v for k, v in profile.items() if k != "top_ops"}))
        return
    prompt = [tokenizer.bos_id, *tokenizer.encode("def ").tolist()]
    prompts = [prompt + [tokenizer.encode(str(i)).tolist()[0]] * i for i in range(args.batch)]  # unequal lengths
    paths = {"A": dict(use_cache=False), "B": dict(use_cache=True)}
    times: dict[str, list[float]] = {"A": [], "B": []}
    cpu_times: dict[str, list[float]] = {"A": [], "B": []}
    outputs: dict[str, list] = {}
    load_before = os.getloadavg()
    for round_ in range(args.rounds):
        for label in ("A", "B") if round_ % 2 == 0 else ("B", "A"):
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            start, cpu_start = time.perf_counter(), time.process_time()
            out = generate_tokens(model, prompts, args.tokens, eos_id=None, device=args.device,
                                  max_context=cfg.data.seq_len, **paths[label])
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            times[label].append(time.perf_counter() - start)
            cpu_times[label].append(time.process_time() - cpu_start)
            outputs.setdefault(label, out)
            print(f"{label} ({'cache' if label == 'B' else 'recompute'}) {times[label][-1]:.2f} s wall, "
                  f"{cpu_times[label][-1]:.2f} s CPU", flush=True)
    identical = outputs["A"] == outputs["B"]
    medians = {label: statistics.median(values) for label, values in times.items()}
    cpu_medians = {label: statistics.median(values) for label, values in cpu_times.items()}
    result = {
        "config": str(Path(args.config).relative_to(HERE)) if Path(args.config).is_relative_to(HERE) else args.config,
        "new_tokens": args.tokens, "batch": args.batch, "rounds": args.rounds, "threads": args.threads,
        "device": args.device, "order": "A B B A ... (A = recompute, B = KV cache)",
        "seconds": times, "median_s": medians, "speedup": medians["A"] / medians["B"],
        # CPU seconds of this process: what each path computed, less sensitive than wall time to
        # the time other jobs take the core away (not to their pressure on the shared caches).
        "cpu_seconds": cpu_times, "cpu_median_s": cpu_medians, "cpu_speedup": cpu_medians["A"] / cpu_medians["B"],
        "tokens_identical": identical, "torch": torch.__version__,
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "load_average_1_5_15_min": {"before": load_before, "after": os.getloadavg()},
        "note": "shared machine (other jobs running); timings are indicative",
    }
    if args.min_of:
        result["per_forward_minimum"] = per_forward_minimum(model, prompt, args.tokens, args.min_of, args.device)
    if args.profile:
        result["decode_step_profile"] = decode_step_profile(model, args.profile)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"speed-up {result['speedup']:.1f}x wall (median recompute {medians['A']:.2f} s / cache "
          f"{medians['B']:.2f} s), {result['cpu_speedup']:.1f}x CPU time, tokens identical: {identical}; "
          f"load average {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    if args.min_of:
        print(f"min-of-{args.min_of} single forwards: estimated speed-up "
              f"{result['per_forward_minimum']['estimated_speedup']:.1f}x")


if __name__ == "__main__":
    main()
