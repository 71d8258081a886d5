"""moetrain's training step against torchtitan 0.3.0's, same model and shape, one CPU process each.

    PYTHONPATH=$PWD/src:$PWD python benchmarks/ab/torchtitan_compare.py driver \
        --torchtitan-python TTVENV/bin/python [--rounds 2] [--steps 2] [--warmup 1] \
        [--dtypes float32,bfloat16] [--out benchmarks/results/torchtitan_compare]

The model is configs/qwen3_moe_debug.toml at the shape of benchmarks/issue_shape.py: Qwen3-MoE,
dim 256, 8 layers, 16 query / 8 KV heads of head_dim 128, QK-norm, 64 experts top-8 of hidden 768,
untied embeddings, vocabulary 2048, microbatches of 2 x 512 tokens, grad_accum 1, 2 intra-op
threads. That is exactly torchtitan's own `debugmodel_moe` Qwen3 flavor, which this script uses
unchanged.

Sides (each measurement a fresh process, A B B A ... so drift on the shared machine hits both):
  moetrain   `moetrain bench train` (moetrain.cli.main in the child, so the child can read its own
             peak RSS), its Trainer on the embedded corpus; bfloat16 = `--parallel.param_dtype
             bfloat16` (bf16 compute, float32 master weights).
  torchtitan torchtitan's own `Trainer` built from its `qwen3_moe_debug` trainer config (model
             flavor `debugmodel_moe`, its FSDP2 wrapping on a 1-rank gloo mesh, its chunked
             cross-entropy loss, its AdamW container (fused), its LR scheduler, its MoE
             load-balancing hook), stepped by its own `Trainer.train_step` (zero_grad, forward,
             loss, backward, clip_grad_norm_ at max_norm 1.0, optimizer and scheduler step);
             this script only times the calls of `train_step`, as `Trainer.train` would make them,
             without its checkpointing or profiler. Changed from that config: batch 2 x 512, the
             number of steps, no activation checkpointing (moetrain's default is none), and the
             data: a random-token data loader and a stub tokenizer written here, because the
             config's tokenizer and c4_test data live in torchtitan's source tree, not its wheel.
             bfloat16 = `training.mixed_precision_param = "bfloat16"` (torchtitan's default, which
             its FSDP2 wrapper applies: bf16 compute, float32 master weights); float32 sets it to
             "float32". Attention: torchtitan's own ScaledDotProductAttention module (causal, eager)
             in place of the config's FlexAttention, which torchtitan compiles with torch.compile
             (max-autotune); moetrain runs eager, so both sides run eager.
             torchtitan picks its device from torch's accelerator probe and has no CPU switch, so
             the child answers that probe with "cpu" and gives torchtitan a small stand-in for
             torch.cuda's device calls (no device memory statistics on CPU) before importing it.

What still differs between the sides (read the ratios with these in mind):
  - torchtitan's GroupedExperts casts the tokens and expert weights to bfloat16 for its
    torch._grouped_mm whatever the mixed precision, so its "float32" rows compute the routed experts
    (96% of the parameters) in bf16; moetrain's float32 rows are float32 throughout.
  - Expert kernels: torchtitan's token dispatcher + torch._grouped_mm (the CPU fallback of torch
    2.13); moetrain's model.moe.impl = "memory_efficient" of the config.
  - Load balancing: torchtitan's auxiliary-loss-free expert bias (load_balance_coeff 1e-3, updated in
    an optimizer pre-hook); moetrain's aux loss of the config (global_batch scope, which with one
    microbatch on one rank takes no extra routing pass). Neither costs a forward.
  - Attention kernels: torch's SDPA (torchtitan) against moetrain's own; loss: torchtitan's chunked
    cross-entropy against moetrain's; FSDP2 on a 1-rank mesh (DTensor parameters) in torchtitan.
  - Data: random token ids (torchtitan) against the embedded corpus (moetrain); the expert load
    (and so the per-expert GEMM shapes) of these few steps from initialisation may differ.
The parameter counts match exactly, group by group (embedding, attention, norms incl. QK-norm,
router, experts, LM head): 315,758,848 on both sides.

torchtitan is not a dependency of moetrain: it runs from its own virtualenv, for example

    python3 -m venv TTVENV
    TTVENV/bin/pip install torch==2.13.0          # the CPU wheel; never an unpinned torch
    TTVENV/bin/pip install --no-deps torchtitan==0.3.0
    TTVENV/bin/pip install -c <(echo torch==2.13.0) numpy torchdata torch_checkpointing \
        spmd_types==0.2.3 "datasets>=3.6,<4.8" "tokenizers>=0.15" safetensors tyro tensorboard \
        einops pillow triton
(wandb is not needed; triton is imported by torchtitan's MoE code even on CPU.)

Each child reports the median step time after the warm-up, tokens/s, its own peak RSS (VmHWM
from /proc/self/status at its end: wait4's ru_maxrss would carry the parent's peak across exec)
and its parameter count (the children are benchmarks/ab/torchtitan_sides.py, which imports neither
this tree's runner nor matplotlib, since the torchtitan virtualenv need not have them). The
driver alternates the sides through `benchmarks/ab/runner.py`, prints, per dtype, the medians per side and the ratios
moetrain / torchtitan of tokens/s and of peak RSS, and writes JSON and the table to --out.json /
--out.txt. This is a benchmark: it asserts nothing about time; it does assert that both sides
train the same number of parameters (in total and per group).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from benchmarks.ab import runner
from benchmarks.ab.torchtitan_sides import MARKER, THREADS
from benchmarks.issue_shape import BATCH, SEQ, VOCAB

SIDES = Path(__file__).resolve().with_name("torchtitan_sides.py")


def _run_child(tree: runner.Tree, steps: int, warmup: int, dtype: str) -> dict:
    env = tree.env(OMP_NUM_THREADS=str(THREADS))
    if tree.label == "torchtitan":
        env["PYTHONPATH"] = str(runner.REPO)  # torchtitan's venv must not see this tree's packages
    child = "torchtitan-child" if tree.label == "torchtitan" else "moetrain-child"
    return runner.run(tree, [str(SIDES), child, str(steps), str(warmup), dtype], marker=MARKER,
                      env=env)


def _check_params(rows: list[dict]) -> dict:
    """Both sides train the same parameters: same total, same count per group."""
    counts = {}
    for side in ("moetrain", "torchtitan"):
        row = next((r for r in rows if r["side"] == side), None)
        if row is not None:
            counts[side] = {"total": row["params"], **row["param_groups"]}
    if len(counts) == 2:
        assert counts["moetrain"] == counts["torchtitan"], f"parameter counts differ: {counts}"
    return counts


def summarize(rows: list[dict], dtypes: list[str], sides: tuple[str, ...] = ("moetrain", "torchtitan")
              ) -> tuple[dict, str]:
    """Medians per side and dtype, and each moetrain side's ratios to torchtitan (overall and per round)."""
    mib = 2**20
    summary, lines = {}, []
    lines.append(f"{'dtype':9s} {'side':11s} {'runs':>4s} {'step s':>8s} {'step cpu s':>10s} {'tokens/s':>9s} "
                 f"{'peak RSS MiB':>13s}")
    for dtype in dtypes:
        med = {}
        for side in sides:
            pick = [r for r in rows if r["side"] == side and r["dtype"] == dtype]
            if not pick:
                continue
            med[side] = {"runs": len(pick), "step_s": statistics.median(r["step_s"] for r in pick),
                         "tokens_per_s": statistics.median(r["tokens_per_s"] for r in pick),
                         "peak_rss_bytes": statistics.median(r["peak_rss_bytes"] for r in pick),
                         "step_cpu_s": statistics.median(r.get("step_cpu_s", float("nan")) for r in pick)}
            m = med[side]
            lines.append(f"{dtype:9s} {side:11s} {m['runs']:4d} {m['step_s']:8.2f} {m['step_cpu_s']:10.2f} "
                         f"{m['tokens_per_s']:9.2f} {m['peak_rss_bytes'] / mib:13.0f}")
        summary[dtype] = {f"{side}_{k}": v for side, m in med.items() for k, v in m.items()}
        for side in [s for s in med if s != "torchtitan"] if "torchtitan" in med else []:
            a, b = med[side], med["torchtitan"]
            ratios = {"tokens_per_s": a["tokens_per_s"] / b["tokens_per_s"],
                      "tokens_per_cpu_s": b["step_cpu_s"] / a["step_cpu_s"],
                      "peak_rss": a["peak_rss_bytes"] / b["peak_rss_bytes"]}
            # Per round, the two sides measured next to each other: the spread of the ratio.
            per_round = []
            for round_ in sorted({r["round"] for r in rows}):
                pair = {r["side"]: r for r in rows if r["dtype"] == dtype and r["round"] == round_}
                if side in pair and "torchtitan" in pair:
                    per_round.append(pair[side]["tokens_per_s"] / pair["torchtitan"]["tokens_per_s"])
            ratios["tokens_per_s_per_round"] = per_round
            lines.append(f"{dtype:9s} {side}/torchtitan: tokens/s {ratios['tokens_per_s']:.2f}x (per round "
                         + ", ".join(f"{x:.2f}" for x in per_round) + f"), per CPU-second "
                         f"{ratios['tokens_per_cpu_s']:.2f}x, peak RSS {ratios['peak_rss']:.2f}x")
            summary[dtype].update({(k if side == "moetrain" else f"{side}_{k}"): v for k, v in ratios.items()})
    return summary, "\n".join(lines)


def driver(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description="moetrain vs torchtitan 0.3.0, one CPU process each")
    parser.add_argument("--torchtitan-python", required=True, help="python of the virtualenv holding torchtitan")
    parser.add_argument("--moetrain-python", default=sys.executable)
    parser.add_argument("--baseline", help="another moetrain checkout (e.g. main), run as a third side \"main\"")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per process (the median is kept)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--out", type=Path, default=runner.RESULTS / "torchtitan_compare",
                        help="writes OUT.json and OUT.txt")
    opts = parser.parse_args(argv)
    dtypes = opts.dtypes.split(",")
    sides = {"moetrain": runner.Tree("moetrain", runner.REPO, opts.moetrain_python),
             "torchtitan": runner.Tree("torchtitan", runner.REPO, opts.torchtitan_python)}
    if opts.baseline:
        sides["main"] = runner.Tree("main", Path(opts.baseline).resolve(), opts.moetrain_python)
    rows = []
    for round_ in range(opts.rounds):
        for dtype in dtypes:
            for side in runner.order(list(sides), round_):
                row = {**_run_child(sides[side], opts.steps, opts.warmup, dtype), "side": side}
                rows.append({"round": round_, **row})
                print(f"round {round_} {side:10s} {dtype:8s}: step {row['step_s']:7.2f} s, "
                      f"{row['tokens_per_s']:7.2f} tokens/s, peak RSS {row['peak_rss_bytes'] / 2**20:6.0f} MiB, "
                      f"{row['params']:,} params, {row['threads']} threads, load {row['loadavg']:.1f}", flush=True)
    params = _check_params(rows)
    summary, text = summarize(rows, dtypes, tuple(sides))
    head = (f"moetrain vs torchtitan 0.3.0: qwen3_moe_debug at vocabulary {VOCAB}, {BATCH} x {SEQ} tokens/step, "
            f"one process, {THREADS} threads, median of {opts.steps} step(s) after {opts.warmup}, "
            f"{opts.rounds} round(s)\nparameters: " + ", ".join(f"{s} {c['total']:,}" for s, c in params.items()))
    text = head + "\n" + text
    print(text)
    runner.save(opts.out, {"rows": rows, "summary": summary, "params": params})
    opts.out.with_suffix(".txt").write_text(text + "\n")


if __name__ == "__main__":
    driver(sys.argv[2:] if sys.argv[1:2] == ["driver"] else sys.argv[1:])
