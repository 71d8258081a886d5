"""moetrain's training step against torchtitan 0.3.0's, same model and shape, one CPU process each.

    PYTHONPATH=src .venv/bin/python benchmarks/torchtitan_compare.py driver \
        --torchtitan-python /tmp/ttvenv/bin/python [--rounds 2] [--steps 2] [--warmup 1] \
        [--dtypes float32,bfloat16] [--out benchmarks/results/torchtitan_compare]

The model is configs/qwen3_moe_debug.toml at the shape of benchmarks/bf16_mfu_ab.py: Qwen3-MoE,
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

    python3 -m venv /tmp/ttvenv
    /tmp/ttvenv/bin/pip install torch==2.13.0          # the CPU wheel; never an unpinned torch
    /tmp/ttvenv/bin/pip install --no-deps torchtitan==0.3.0
    /tmp/ttvenv/bin/pip install -c <(echo torch==2.13.0) numpy torchdata torch_checkpointing \
        spmd_types==0.2.3 "datasets>=3.6,<4.8" "tokenizers>=0.15" safetensors tyro tensorboard \
        einops pillow triton
(wandb is not needed; triton is imported by torchtitan's MoE code even on CPU.)

Each child reports the median step time after the warm-up, tokens/s, its own peak RSS (VmHWM
from /proc/self/status at its end: wait4's ru_maxrss would carry the parent's peak across exec)
and its parameter count. The driver prints, per dtype, the medians per side and the ratios
moetrain / torchtitan of tokens/s and of peak RSS, and writes JSON and the table to --out.json /
--out.txt. This is a benchmark: it asserts nothing about time; it does assert that both sides
train the same number of parameters (in total and per group).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
VOCAB, BATCH, SEQ, THREADS = 2048, 2, 512, 2
# benchmarks/bf16_mfu_ab.py's ARGS: the qwen3_moe_debug model at vocabulary 2048, 2 x 512 tokens.
ARGS = ["--config", "configs/qwen3_moe_debug.toml", "--model.vocab_size", str(VOCAB), "--data.seq_len", str(SEQ),
        "--train.microbatch_size", str(BATCH), "--train.grad_accum", "1", "--data.max_documents", "300",
        "--train.num_threads", str(THREADS)]
# Parameter groups by name, for the two sides' different module names.
GROUPS = [("embedding", r"tok_embeddings|embed"), ("lm_head", r"^output\.|lm_head|^head\."),
          ("router", r"router|gate\.weight$|\.gate$"), ("experts", r"experts"),
          ("norms", r"norm"), ("attention", r"attention|attn")]


def _group(name: str) -> str:
    return next((group for group, pattern in GROUPS if re.search(pattern, name)), "other")


def _param_groups(named: list[tuple[str, int]]) -> dict[str, int]:
    out: Counter[str] = Counter()
    for name, numel in named:
        out[_group(name)] += numel
    return dict(out)


def _peak_rss_bytes() -> int:
    """This process's own RSS high-water mark (VmHWM), not inherited through exec like ru_maxrss."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return -1


def _emit(row: dict) -> None:
    print("RESULT " + json.dumps(row), flush=True)


def moetrain_child(argv: list[str]) -> None:
    """`moetrain bench train` in this process, then its numbers, parameter count and peak RSS."""
    steps, warmup, dtype = argv
    import torch

    from moetrain.cli import main
    from moetrain.config.job import parse_job_args
    from moetrain.model.transformer import Transformer

    args = [*ARGS, "--parallel.param_dtype", dtype]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        code = main(["bench", "train", "--steps", steps, "--warmup", warmup, "--json", str(out), *args])
        if code != 0:
            raise SystemExit(code)
        bench = json.loads(out.read_text())
    peak = _peak_rss_bytes()
    with torch.device("meta"):  # no memory: the count only, after the peak was read
        model = Transformer(parse_job_args(args).model)
    named = [(name, p.numel()) for name, p in model.named_parameters()]
    _emit({"side": "moetrain", "dtype": dtype, "step_s": bench["step_s_median"],
           "tokens_per_step": bench["tokens_per_step"], "tokens_per_s": bench["tokens_per_s"],
           "peak_rss_bytes": peak, "threads": bench["threads_per_rank"], "losses": bench["losses"],
           "params": sum(n for _, n in named), "param_groups": _param_groups(named),
           "loadavg": os.getloadavg()[0]})


class _CpuDeviceModule:
    """What torchtitan asks of its device module (torch.cuda's API), answered for the CPU."""

    def __getattr__(self, name: str):
        import torch

        return getattr(torch.cpu, name)

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def set_device(device: object) -> None:
        pass

    @staticmethod
    def get_device_name(device: object = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device: object = None):
        from types import SimpleNamespace

        return SimpleNamespace(total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))

    @staticmethod
    def memory_stats(device: object = None) -> dict:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device: object = None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass

    @staticmethod
    def synchronize(device: object = None) -> None:
        pass


def torchtitan_child(argv: list[str]) -> None:
    """torchtitan's Trainer on its qwen3_moe_debug config at this shape; times its own train_step."""
    steps, warmup, dtype = int(argv[0]), int(argv[1]), argv[2]
    import torch
    import torch._utils

    # torchtitan reads the device type and module once, at import: answer "cpu" before importing it.
    module_of = torch._utils._get_device_module
    torch._utils._get_available_device_type = lambda: "cpu"
    torch._utils._get_device_module = lambda kind=None: _CpuDeviceModule() if kind == "cpu" else module_of(kind)
    torch.set_num_threads(THREADS)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})

    from dataclasses import dataclass

    import torchtitan
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    class StubTokenizer(BaseTokenizer):
        """Nothing is tokenized: the data below are token ids already."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            pass

        def __init__(self, config: Config, **kwargs: object) -> None:
            super().__init__()

        def encode(self, *args: object, **kwargs: object) -> list[int]:
            raise NotImplementedError

        def decode(self, *args: object, **kwargs: object) -> str:
            raise NotImplementedError

        def get_vocab_size(self) -> int:
            return VOCAB

    class RandomTokens(BaseDataLoader):
        """Endless (input, labels) batches of uniform random token ids, one document per row."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            pass

        def __init__(self, config: Config, *, seq_len: int, local_batch_size: int, **kwargs: object) -> None:
            self.seq_len, self.batch = seq_len, local_batch_size
            self.generator = torch.Generator().manual_seed(0)

        def __iter__(self):
            while True:
                ids = torch.randint(0, VOCAB, (self.batch, self.seq_len + 1), generator=self.generator)
                yield {"input": ids[:, :-1].contiguous()}, ids[:, 1:].contiguous()

        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state_dict: dict) -> None:
            pass

    config = qwen3_moe_debug()
    config.training.local_batch_size = BATCH
    config.training.seq_len = SEQ
    config.training.steps = warmup + steps
    config.training.mixed_precision_param = dtype
    config.activation_checkpoint = None
    config.checkpoint.enable = False
    config.tokenizer = StubTokenizer.Config()
    config.dataloader = RandomTokens.Config()
    config.metrics.log_freq = 1
    # Causal SDPA instead of the compiled FlexAttention (without positions: one document per row).
    for _, _, parent, field in list(config.model_spec.model.traverse(FlexAttention.Config)):
        setattr(parent, field, ScaledDotProductAttention.Config())
    with tempfile.TemporaryDirectory() as tmp:
        config.dump_folder = tmp
        trainer = config.build()
        data = trainer.batch_generator(trainer.dataloader)
        times = []
        for index in range(warmup + steps):
            trainer.step += 1
            trainer.gc_handler.run(trainer.step)
            start = time.perf_counter()
            trainer.train_step(data)
            if index >= warmup:
                times.append(time.perf_counter() - start)
        peak = _peak_rss_bytes()
        named = [(name, p.numel()) for part in trainer.model_parts for name, p in part.named_parameters()]
        trainer.close()
    step_s = statistics.median(times)
    _emit({"side": "torchtitan", "dtype": dtype, "step_s": step_s, "tokens_per_step": BATCH * SEQ,
           "tokens_per_s": BATCH * SEQ / step_s, "peak_rss_bytes": peak, "threads": torch.get_num_threads(),
           "params": sum(n for _, n in named), "param_groups": _param_groups(named), "attention": "sdpa",
           "torchtitan_version": torchtitan.__version__, "loadavg": os.getloadavg()[0]})


def _run_child(side: str, python: str, steps: int, warmup: int, dtype: str) -> dict | None:
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS)}
    if side == "moetrain":
        env["PYTHONPATH"] = str(HERE / "src")
    else:
        env.pop("PYTHONPATH", None)  # torchtitan's venv must not see this tree's packages
    proc = subprocess.run([python, str(Path(__file__).resolve()), f"{side}-child", str(steps), str(warmup), dtype],
                          cwd=HERE, env=env, capture_output=True, text=True, check=False)
    line = next((x for x in reversed(proc.stdout.splitlines()) if x.startswith("RESULT ")), None)
    if line is None:
        print(f"{side} {dtype} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(line.removeprefix("RESULT "))


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


def summarize(rows: list[dict], dtypes: list[str]) -> tuple[dict, str]:
    mib = 2**20
    summary, lines = {}, []
    lines.append(f"{'dtype':9s} {'side':11s} {'runs':>4s} {'step s':>8s} {'tokens/s':>9s} {'peak RSS MiB':>13s}")
    for dtype in dtypes:
        med = {}
        for side in ("moetrain", "torchtitan"):
            pick = [r for r in rows if r["side"] == side and r["dtype"] == dtype]
            if not pick:
                continue
            med[side] = {"runs": len(pick), "step_s": statistics.median(r["step_s"] for r in pick),
                         "tokens_per_s": statistics.median(r["tokens_per_s"] for r in pick),
                         "peak_rss_bytes": statistics.median(r["peak_rss_bytes"] for r in pick)}
            m = med[side]
            lines.append(f"{dtype:9s} {side:11s} {m['runs']:4d} {m['step_s']:8.2f} {m['tokens_per_s']:9.2f} "
                         f"{m['peak_rss_bytes'] / mib:13.0f}")
        if len(med) == 2:
            a, b = med["moetrain"], med["torchtitan"]
            ratios = {"tokens_per_s": a["tokens_per_s"] / b["tokens_per_s"],
                      "peak_rss": a["peak_rss_bytes"] / b["peak_rss_bytes"]}
            # Per round, the two sides measured next to each other: the spread of the ratio.
            per_round = []
            for round_ in sorted({r["round"] for r in rows}):
                pair = {r["side"]: r for r in rows if r["dtype"] == dtype and r["round"] == round_}
                if len(pair) == 2:
                    per_round.append(pair["moetrain"]["tokens_per_s"] / pair["torchtitan"]["tokens_per_s"])
            ratios["tokens_per_s_per_round"] = per_round
            lines.append(f"{dtype:9s} moetrain/torchtitan: tokens/s {ratios['tokens_per_s']:.2f}x (per round "
                         + ", ".join(f"{x:.2f}" for x in per_round) + f"), peak RSS {ratios['peak_rss']:.2f}x")
            summary[dtype] = {**{f"{side}_{k}": v for side, m in med.items() for k, v in m.items()}, **ratios}
    return summary, "\n".join(lines)


def driver(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description="moetrain vs torchtitan 0.3.0, one CPU process each")
    parser.add_argument("--torchtitan-python", required=True, help="python of the virtualenv holding torchtitan")
    parser.add_argument("--moetrain-python", default=sys.executable)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per process (the median is kept)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--out", type=Path, default=HERE / "benchmarks/results/torchtitan_compare",
                        help="writes OUT.json and OUT.txt")
    opts = parser.parse_args(argv)
    dtypes = opts.dtypes.split(",")
    python = {"moetrain": opts.moetrain_python, "torchtitan": opts.torchtitan_python}
    rows = []
    for round_ in range(opts.rounds):
        for dtype in dtypes:
            order = ("moetrain", "torchtitan") if round_ % 2 == 0 else ("torchtitan", "moetrain")
            for side in order:
                row = _run_child(side, python[side], opts.steps, opts.warmup, dtype)
                if row is None:
                    continue
                rows.append({"round": round_, **row})
                print(f"round {round_} {side:10s} {dtype:8s}: step {row['step_s']:7.2f} s, "
                      f"{row['tokens_per_s']:7.2f} tokens/s, peak RSS {row['peak_rss_bytes'] / 2**20:6.0f} MiB, "
                      f"{row['params']:,} params, {row['threads']} threads, load {row['loadavg']:.1f}", flush=True)
    params = _check_params(rows)
    summary, text = summarize(rows, dtypes)
    head = (f"moetrain vs torchtitan 0.3.0: qwen3_moe_debug at vocabulary {VOCAB}, {BATCH} x {SEQ} tokens/step, "
            f"one process, {THREADS} threads, median of {opts.steps} step(s) after {opts.warmup}, "
            f"{opts.rounds} round(s)\nparameters: " + ", ".join(f"{s} {c['total']:,}" for s, c in params.items()))
    text = head + "\n" + text
    print(text)
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.with_suffix(".txt").write_text(text + "\n")
    opts.out.with_suffix(".json").write_text(json.dumps({"rows": rows, "summary": summary, "params": params,
                                                         "argv": sys.argv, "time": time.time()}, indent=2) + "\n")


if __name__ == "__main__":
    {"driver": driver, "moetrain-child": moetrain_child, "torchtitan-child": torchtitan_child}[sys.argv[1]](
        sys.argv[2:])
