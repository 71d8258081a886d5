"""Self-speculative decoding with the MTP modules against plain greedy, on a trained run's newest checkpoint.

For each prompt (held-out-like snippets of Python), greedy decoding with the KV cache and MTP-drafted
greedy decoding (`moetrain.evaluate.generate.mtp_speculative_greedy`) run alternately, `--repeats` times
each, on one intra-op thread; the report gives per prompt the drafts accepted, tokens per verifying
forward, the median time of each and their ratio, and whether the tokens agree. On a shared machine the
ratio of medians measured side by side is the number to read, not the times. A third variant, alternated with
the two, runs speculative decoding with its few-token forwards (the verify forward, the MTP catch-up) on the
general path instead of the decode step's (`moetrain.model.kv_cache.FEW_TOKENS = 1`): what the speed-up was
before those forwards took the decode path. `--forward-costs N` first times the forwards themselves, N rounds
alternated, each round starting with the next kind (a one-token decode step; a two-token verify forward on the
decode path and on the general path; the MTP module's forward of one and of two tokens), each the median over
the rounds: steadier than whole generations on a loaded machine.

    PYTHONPATH=src:. .venv/bin/python benchmarks/quality/mtp_speculative.py --run-dir RUN --tokens 128

Benchmark only: nothing here asserts a number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from moetrain.checkpoint.manifest import newest_intact
from moetrain.checkpoint.state import stored_config
from moetrain.checkpoint.storage import load_model_weights
from moetrain.data.tokenizer import build_tokenizer
from moetrain.evaluate.generate import generate_tokens, mtp_speculative_greedy
from moetrain.model import kv_cache
from moetrain.runtime.run_dir import RunDir
from moetrain.train.build import build_model

PROMPTS = ["def ", "import os\n", "class ", "    def __init__(self", "for i in range(", "if __name__ == "]


def forward_costs(model, rounds: int, context: int = 40, capacity: int = 400) -> dict[str, float]:
    """Median seconds of each kind of cached forward (see the module docstring), alternated over `rounds`."""
    depth_layers = len(model.layers) + model.cfg.mtp_depth
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> torch.Tensor:
        return torch.randint(0, model.cfg.vocab_size, (1, n), generator=gen)

    def main_forward(n: int, few: int) -> float:
        kv_cache.FEW_TOKENS, cache = few, kv_cache.KVCache(depth_layers, 1, capacity)
        model.cached_forward(tokens(context), cache)
        for timed in (False, True):  # the first forward makes the cache's tables (once per generation): untimed
            start = time.perf_counter()
            for _ in range(10 if timed else 1):
                model.cached_forward(tokens(n), cache)
                cache.rewind(cache.length - n + 1)
        return (time.perf_counter() - start) / 10

    def mtp_forward(n: int) -> float:
        cache = kv_cache.KVCache(depth_layers, 1, capacity)
        hidden = torch.randn(1, context, model.cfg.dim, generator=gen)
        model.mtp_cached_forward(1, hidden, tokens(context), cache)
        for timed in (False, True):
            start = time.perf_counter()
            for _ in range(10 if timed else 1):
                model.mtp_cached_forward(1, hidden[:, :n], tokens(n), cache)
                cache.rewind(cache.length - n + 1)
        return (time.perf_counter() - start) / 10

    few_tokens = kv_cache.FEW_TOKENS
    times: dict[str, list[float]] = {k: [] for k in ("decode_1", "verify_2_decode_path", "verify_2_general_path",
                                                      "mtp_1", "mtp_2")}
    try:
        with torch.inference_mode():
            kinds = {"decode_1": lambda: main_forward(1, few_tokens),
                     "verify_2_decode_path": lambda: main_forward(2, few_tokens),
                     "verify_2_general_path": lambda: main_forward(2, 1), "mtp_1": lambda: mtp_forward(1),
                     "mtp_2": lambda: mtp_forward(2)}
            order = list(kinds)
            for round_ in range(rounds):  # each round starts with the next kind: no kind always runs first
                for name in order[round_ % len(order):] + order[:round_ % len(order)]:
                    times[name].append(kinds[name]())
    finally:
        kv_cache.FEW_TOKENS = few_tokens
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="write the rows as JSON here too")
    parser.add_argument("--forward-costs", type=int, default=0, help="rounds of the per-forward timing (0: none)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    run_dir = RunDir(Path(args.run_dir))
    ref, _ = newest_intact(run_dir.checkpoints)
    cfg = stored_config(ref) or run_dir.load_config()
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    model = build_model(cfg.model, weights="none")
    load_model_weights(ref, model)
    model.eval()
    if args.forward_costs:
        costs = forward_costs(model, args.forward_costs)
        print(f"forward costs, median of {args.forward_costs} alternated rounds (ms): "
              + ", ".join(f"{k} {1000 * v:.1f}" for k, v in costs.items()))
        print(f"verify of 2 / decode of 1: decode path {costs['verify_2_decode_path'] / costs['decode_1']:.2f}, "
              f"general path {costs['verify_2_general_path'] / costs['decode_1']:.2f}")
        if args.out:
            Path(args.out).with_suffix(".forwards.json").write_text(json.dumps(costs, indent=1) + "\n")
    rows = []
    for prompt in PROMPTS:
        context = [tokenizer.bos_id, *tokenizer.encode(prompt).tolist()]
        times = {"speculative": [], "plain": [], "general": []}
        few_tokens = kv_cache.FEW_TOKENS
        for _ in range(args.repeats):  # alternate, so all see the same machine load
            start = time.perf_counter()
            drafted, stats = mtp_speculative_greedy(model, context, args.tokens)
            times["speculative"].append(time.perf_counter() - start)
            start = time.perf_counter()
            plain = generate_tokens(model, [context], args.tokens)[0]
            times["plain"].append(time.perf_counter() - start)
            kv_cache.FEW_TOKENS = 1  # only one-token forwards are decode steps: the earlier speculative path
            try:
                start = time.perf_counter()
                general, _ = mtp_speculative_greedy(model, context, args.tokens)
                times["general"].append(time.perf_counter() - start)
            finally:
                kv_cache.FEW_TOKENS = few_tokens
        spec, base, slow = (statistics.median(times[k]) for k in ("speculative", "plain", "general"))
        rows.append({"prompt": prompt, "tokens": len(drafted), "proposed": stats.proposed, "accepted": stats.accepted,
                     "acceptance": stats.acceptance_rate, "tokens_per_verify": len(drafted) / stats.verify_forwards,
                     "speculative_s": spec, "plain_s": base, "speed_up": base / spec, "general_path_s": slow,
                     "general_path_speed_up": base / slow, "identical": drafted == plain == general})
    print(f"run {args.run_dir} step {ref.step}, mtp_depth {cfg.model.mtp_depth}, {args.tokens} tokens, "
          f"median of {args.repeats} alternated runs, one thread")
    print("| prompt | drafts accepted | tokens / verifying forward | speculative s | plain s | speed-up "
          "| general path s | its speed-up | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['prompt']!r} | {r['accepted']}/{r['proposed']} ({100 * r['acceptance']:.0f}%) | "
              f"{r['tokens_per_verify']:.2f} | {r['speculative_s']:.3f} | {r['plain_s']:.3f} | "
              f"{r['speed_up']:.2f}x | {r['general_path_s']:.3f} | {r['general_path_speed_up']:.2f}x | "
              f"{r['identical']} |")
    accepted, proposed = sum(r["accepted"] for r in rows), sum(r["proposed"] for r in rows)
    plain_s = sum(r["plain_s"] for r in rows)
    print(f"all prompts: {accepted}/{proposed} drafts accepted ({100 * accepted / max(proposed, 1):.1f}%), "
          f"speed-up {plain_s / sum(r['speculative_s'] for r in rows):.2f}x (few-token forwards on the general "
          f"path: {plain_s / sum(r['general_path_s'] for r in rows):.2f}x)")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
