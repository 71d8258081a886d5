"""`moetrain bench moe`: the routed-expert implementations side by side, in one process, same inputs.

For each implementation (per-expert loop, grouped GEMM with standard autograd, memory-efficient
Function) it measures the bytes saved for backward (unique storages seen by
`torch.autograd.graph.saved_tensors_hooks`, parameters excluded) and the forward+backward time
(median over repeats after warm-up, implementations interleaved so machine noise hits all alike),
and reports ratios to the grouped path. On CPU it also times both grouped GEMM backends
(`torch._grouped_mm` and the loop over contiguous expert segments), which is how the CPU backend
in `moetrain.model.grouped_mm` was chosen. `--sweep` varies granularity at constant top_k *
intermediate and plots saved MiB (PNG + JSON under benchmarks/results/).

Options: `--preset` (read first) sets the defaults of the shape options, every `BenchConfig`
field can be overridden (`--tokens`, `--top_k` or `--top-k`, ...), and booleans are flags
(`--sweep`, `--no-backend-comparison`).

This is a benchmark, not a test: it asserts nothing about time. User errors raise ConfigError.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.pyplot as plt
import torch

from moetrain.args import check_output_path, parse_typed_args, take_option
from moetrain.bench import results_dir
from moetrain.dtypes import DTYPES
from moetrain.errors import ConfigError
from moetrain.model.experts import IMPLS, routed_experts
from moetrain.model.grouped_mm import ACTIVATIONS, BACKENDS, grouped_mm_backend
from moetrain.model.routing import Routing, routing_from_topk
from moetrain.observe.peak_flops import PEAK_SIZES, best_gemm_flops
from moetrain.runtime.allocator import reuse_freed_host_memory

matplotlib.use("Agg")  # the sweep plot goes to a file only; never needs a display

PROG = "moetrain bench moe"

RESULTS_DIR = results_dir()
# (n_experts, top_k, intermediate) at constant top_k * intermediate = 1024.
GRANULARITY_SWEEP: tuple[tuple[int, int, int], ...] = ((8, 1, 1024), (16, 2, 512), (32, 4, 256), (64, 8, 128),
                                                       (128, 16, 64))


@dataclass
class BenchConfig:
    tokens: int = 4096
    hidden: int = 512
    intermediate: int = 128
    n_experts: int = 64
    top_k: int = 8
    activation: str = "swiglu"
    dtype: str = "float32"
    device: str = "cpu"
    warmup: int = 2
    repeats: int = 7
    seed: int = 0
    # CPU threads for torch (0 = torch's default); 1 gives steadier ratios on a shared, busy machine.
    threads: int = 0
    # Grouped GEMM backend for the main table; "auto" = moetrain's per-device choice.
    backend: str = "auto"
    # What times a pass and the GEMM peak: "wall" (perf_counter) or "cpu" (the process's CPU time,
    # CPU only), which on a shared, oversubscribed machine measures the work instead of the queue.
    clock: str = "wall"


PRESETS: dict[str, dict[str, Any]] = {
    "fine": dict(hidden=512, intermediate=128, n_experts=64, top_k=8, tokens=4096),
    "coarse": dict(hidden=1024, intermediate=512, n_experts=8, top_k=2, tokens=4096),
    # The routed experts of one configs/qwen3_moe_debug.toml layer on one 2 x 512-token microbatch.
    "qwen3_moe_debug": dict(hidden=256, intermediate=768, n_experts=64, top_k=8, tokens=1024),
}


def _validate(cfg: BenchConfig) -> None:
    def check(ok: bool, name: str, valid: str) -> None:
        if not ok:
            raise ConfigError(f"--{name} = {getattr(cfg, name)!r} is invalid: {valid}")

    for name in ("tokens", "hidden", "intermediate", "n_experts", "top_k"):
        check(getattr(cfg, name) >= 1, name, "must be >= 1")
    check(cfg.top_k <= cfg.n_experts, "top_k", f"must be <= n_experts ({cfg.n_experts})")
    check(cfg.repeats >= 5, "repeats", "must be >= 5 (the median needs at least 5 samples)")
    check(cfg.warmup >= 0, "warmup", "must be >= 0")
    check(cfg.threads >= 0, "threads", "must be >= 0 (0 = torch default)")
    check(cfg.activation in ACTIVATIONS, "activation", f"valid: {', '.join(ACTIVATIONS)}")
    check(cfg.dtype in ("float32", "bfloat16", "float64"), "dtype", "valid: float32, bfloat16, float64")
    check(cfg.backend in ("auto", *BACKENDS), "backend", f"valid: auto, {', '.join(BACKENDS)}")
    check(cfg.device in ("cpu", "cuda"), "device", "valid: cpu, cuda")
    check(cfg.clock in ("wall", "cpu") and not (cfg.clock == "cpu" and cfg.device != "cpu"), "clock",
          "valid: wall, cpu (cpu only with --device cpu)")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device = 'cuda' is invalid: no CUDA device is available here; use cpu")


@dataclass
class Inputs:
    x: torch.Tensor
    routing: Routing
    w1: torch.Tensor
    w2: torch.Tensor
    grad_out: torch.Tensor


def make_inputs(cfg: BenchConfig) -> Inputs:
    """One set of inputs shared by every implementation: softmax router scores (a leaf, so the score
    gradient is computed but the router itself is outside the timed region), top-k, renormalised."""
    gen = torch.Generator().manual_seed(cfg.seed)
    dtype, device = DTYPES[cfg.dtype], torch.device(cfg.device)
    width = 2 * cfg.intermediate if cfg.activation == "swiglu" else cfg.intermediate

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, dtype=torch.float32) * scale).to(device=device, dtype=dtype)

    x = randn(cfg.tokens, cfg.hidden).requires_grad_()
    logits = torch.randn(cfg.tokens, cfg.n_experts, generator=gen)
    top_scores, top_idx = logits.softmax(-1).topk(cfg.top_k, dim=-1)
    top_scores = top_scores / top_scores.sum(-1, keepdim=True)
    routing = routing_from_topk(top_idx.to(device), top_scores.to(device=device, dtype=dtype), cfg.n_experts)
    routing.scores.requires_grad_()
    w1 = torch.nn.Parameter(randn(cfg.n_experts, cfg.hidden, width, scale=cfg.hidden ** -0.5))
    w2 = torch.nn.Parameter(randn(cfg.n_experts, cfg.intermediate, cfg.hidden, scale=cfg.intermediate ** -0.5))
    return Inputs(x=x, routing=routing, w1=w1, w2=w2, grad_out=randn(cfg.tokens, cfg.hidden))


def _forward(inputs: Inputs, cfg: BenchConfig, impl: str, backend: str) -> torch.Tensor:
    return routed_experts(inputs.x, inputs.routing, inputs.w1, inputs.w2, cfg.activation, impl, backend=backend)


def saved_bytes(inputs: Inputs, cfg: BenchConfig, impl: str, backend: str) -> int:
    """Bytes of the unique storages autograd saves for backward during one forward, parameters excluded."""
    param_storages = {p.untyped_storage().data_ptr() for p in (inputs.w1, inputs.w2)}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in param_storages:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = _forward(inputs, cfg, impl, backend)
    del out
    return sum(storages.values())


def formula_bytes(cfg: BenchConfig) -> int:
    """Closed-form minimum for the memory-efficient Function: X + H + scores + token indices + counts."""
    elem = DTYPES[cfg.dtype].itemsize
    assignments = cfg.tokens * cfg.top_k
    width = 2 * cfg.intermediate if cfg.activation == "swiglu" else cfg.intermediate
    return (cfg.tokens * cfg.hidden * elem + assignments * width * elem + assignments * elem
            + assignments * 8 + cfg.n_experts * 8)


def layer_flops(cfg: BenchConfig) -> float:
    """The routed experts' GEMM FLOPs per forward+backward: 3 x (2 A d (width of W1) + 2 A n d), A = tokens x top_k.

    The backward's two GEMMs per projection (input and weight gradient) are twice the forward's.
    """
    width = 2 * cfg.intermediate if cfg.activation == "swiglu" else cfg.intermediate
    return 3.0 * 2 * cfg.tokens * cfg.top_k * cfg.hidden * (width + cfg.intermediate)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _fwd_bwd_once(inputs: Inputs, cfg: BenchConfig, impl: str, backend: str) -> float:
    for tensor in (inputs.x, inputs.routing.scores, inputs.w1, inputs.w2):
        tensor.grad = None
    timer = time.perf_counter if cfg.clock == "wall" else time.process_time
    _sync(cfg.device)
    start = timer()
    _forward(inputs, cfg, impl, backend).backward(inputs.grad_out)
    _sync(cfg.device)
    return (timer() - start) * 1e3


def time_variants(inputs: Inputs, cfg: BenchConfig, variants: list[tuple[str, str]]) -> dict[tuple[str, str], float]:
    """Median fwd+bwd ms per (impl, backend), variants interleaved within every repeat."""
    for _ in range(cfg.warmup):
        for impl, backend in variants:
            _fwd_bwd_once(inputs, cfg, impl, backend)
    samples: dict[tuple[str, str], list[float]] = {v: [] for v in variants}
    for _ in range(cfg.repeats):
        for variant in variants:
            samples[variant].append(_fwd_bwd_once(inputs, cfg, *variant))
    return {v: statistics.median(s) for v, s in samples.items()}


def _backend_for(cfg: BenchConfig, impl: str) -> str:
    if cfg.backend != "auto":
        return cfg.backend
    return grouped_mm_backend(torch.device(cfg.device), DTYPES[cfg.dtype], impl)


def run_preset(cfg: BenchConfig, compare_backends: bool) -> dict[str, Any]:
    inputs = make_inputs(cfg)
    chosen = {impl: _backend_for(cfg, impl) for impl in IMPLS}
    variants = [(impl, chosen[impl]) for impl in IMPLS]
    if compare_backends:
        variants += [(impl, other) for impl in ("grouped", "memory_efficient") for other in BACKENDS
                     if other != chosen[impl]]
    times = time_variants(inputs, cfg, variants)
    # The same-dtype GEMM peak the MFU of `bench train` uses (the best square product of PEAK_SIZES,
    # this process's threads), taken right after the timings so both see the same machine.
    peak = (best_gemm_flops(DTYPES[cfg.dtype], cfg.device, torch.get_num_threads(), clock=cfg.clock)
            if cfg.device == "cpu" else None)
    flops = layer_flops(cfg)
    results = []
    grouped_bytes = saved_bytes(inputs, cfg, "grouped", chosen["grouped"])
    grouped_ms = times[("grouped", chosen["grouped"])]
    for impl in IMPLS:
        nbytes = saved_bytes(inputs, cfg, impl, chosen[impl])
        entry: dict[str, Any] = {
            "impl": impl,
            "backend": "per-expert matmuls" if impl == "loop" else chosen[impl],
            "saved_bytes": nbytes,
            "saved_mib": nbytes / 2**20,
            "fwd_bwd_ms": times[(impl, chosen[impl])],
            "saved_ratio_to_grouped": nbytes / grouped_bytes,
            "time_ratio_to_grouped": times[(impl, chosen[impl])] / grouped_ms,
            "gemm_flops_per_s": flops / (times[(impl, chosen[impl])] / 1e3),
        }
        if peak is not None:
            entry["fraction_of_gemm_peak"] = entry["gemm_flops_per_s"] / peak
        if impl == "memory_efficient":
            entry["formula_bytes"] = formula_bytes(cfg)
            entry["saved_over_formula"] = nbytes / entry["formula_bytes"]
        results.append(entry)
    report: dict[str, Any] = {"config": dataclasses.asdict(cfg), "results": results,
                              "chosen_backends": {impl: chosen[impl] for impl in ("grouped", "memory_efficient")},
                              "torch": torch.__version__, "threads": torch.get_num_threads(),
                              "layer_gemm_flops": flops, "gemm_peak_flops_per_s": peak}
    if compare_backends:
        report["backend_comparison"] = [
            {"impl": impl, "backend": backend, "fwd_bwd_ms": ms, "time_ratio_to_chosen_grouped": ms / grouped_ms,
             "chosen": backend == chosen[impl]}
            for (impl, backend), ms in sorted(times.items()) if impl != "loop"
        ]
    return report


def run_sweep(base: BenchConfig, timed: bool = True) -> list[dict[str, Any]]:
    """Saved bytes per implementation (and fwd+bwd time of grouped vs memory_efficient) across
    granularity at constant top_k * intermediate."""
    rows = []
    for n_experts, top_k, intermediate in GRANULARITY_SWEEP:
        cfg = dataclasses.replace(base, n_experts=n_experts, top_k=top_k, intermediate=intermediate)
        inputs = make_inputs(cfg)
        row: dict[str, Any] = {"n_experts": n_experts, "top_k": top_k, "intermediate": intermediate,
                               "formula_bytes": formula_bytes(cfg)}
        for impl in IMPLS:
            row[f"{impl}_saved_bytes"] = saved_bytes(inputs, cfg, impl, _backend_for(cfg, impl))
        if timed:
            variants = [(impl, _backend_for(cfg, impl)) for impl in ("grouped", "memory_efficient")]
            for (impl, _), ms in time_variants(inputs, cfg, variants).items():
                row[f"{impl}_fwd_bwd_ms"] = ms
            ratio = row["memory_efficient_fwd_bwd_ms"] / row["grouped_fwd_bwd_ms"]
            row["time_ratio_memory_efficient_to_grouped"] = ratio
        rows.append(row)
    return rows


def plot_sweep(rows: list[dict[str, Any]], path: Path) -> None:
    labels = [f"E={r['n_experts']}\nk={r['top_k']}\nn={r['intermediate']}" for r in rows]
    xs = list(range(len(rows)))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    # loop is drawn last, dotted and hollow, because it saves exactly what grouped saves and would hide under it.
    styles = {"grouped": dict(marker="s"), "memory_efficient": dict(marker="D"),
              "loop": dict(marker="o", linestyle=":", markerfacecolor="none", markersize=10)}
    for impl in ("grouped", "memory_efficient", "loop"):
        ax.plot(xs, [r[f"{impl}_saved_bytes"] / 2**20 for r in rows], label=impl, **styles[impl])
    ax.plot(xs, [r["formula_bytes"] / 2**20 for r in rows], linestyle="--", color="gray",
            label="closed-form minimum (X+H+S+idx)")
    ax.set_xticks(xs, labels)
    ax.set_ylabel("bytes saved for backward (MiB)")
    ax.set_xlabel("granularity (constant top_k x intermediate)")
    ax.set_title("MoE activation memory vs expert granularity")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_table(report: dict[str, Any]) -> str:
    lines = [f"{'impl':18s} {'backend':18s} {'saved MiB':>10s} {'x grouped':>9s} {'fwd+bwd ms':>11s} {'x grouped':>9s}"
             f" {'GFLOP/s':>8s} {'of peak':>8s}"]
    for r in report["results"]:
        of_peak = f"{100 * r['fraction_of_gemm_peak']:7.1f}%" if "fraction_of_gemm_peak" in r else f"{'-':>8s}"
        lines.append(f"{r['impl']:18s} {r['backend']:18s} {r['saved_mib']:10.2f} {r['saved_ratio_to_grouped']:9.3f} "
                     f"{r['fwd_bwd_ms']:11.2f} {r['time_ratio_to_grouped']:9.3f} {r['gemm_flops_per_s'] / 1e9:8.1f} "
                     f"{of_peak}")
    if report.get("gemm_peak_flops_per_s"):
        sizes = ",".join(f"{n}^2" for n in PEAK_SIZES)
        lines.append(f"GEMM peak ({report['config']['dtype']}, best of {sizes}, {report['threads']} thread(s), "
                     f"same run, {report['config']['clock']} clock): "
                     f"{report['gemm_peak_flops_per_s'] / 1e9:.1f} GFLOP/s; the layer's GEMMs: "
                     f"{report['layer_gemm_flops'] / 1e9:.2f} GFLOP per forward+backward")
    mem = next(r for r in report["results"] if r["impl"] == "memory_efficient")
    lines.append(f"memory_efficient formula: {mem['formula_bytes'] / 2**20:.2f} MiB "
                 f"(measured / formula = {mem['saved_over_formula']:.4f})")
    if "backend_comparison" in report:
        lines.append("grouped GEMM backends (same run):")
        for r in report["backend_comparison"]:
            lines.append(f"  {r['impl']:18s} {r['backend']:18s} {r['fwd_bwd_ms']:9.2f} ms "
                         f"({r['time_ratio_to_chosen_grouped']:.3f} x grouped){'  <- chosen' if r['chosen'] else ''}")
    return "\n".join(lines)


def format_sweep(rows: list[dict[str, Any]]) -> str:
    timed = "grouped_fwd_bwd_ms" in rows[0]
    header = f"{'E':>4s} {'k':>3s} {'n':>5s} " + " ".join(f"{impl + ' MiB':>22s}" for impl in IMPLS) \
        + f" {'formula MiB':>12s}"
    if timed:
        header += f" {'grouped ms':>11s} {'mem_eff ms':>11s} {'ratio':>6s}"
    lines = [header]
    for r in rows:
        line = f"{r['n_experts']:4d} {r['top_k']:3d} {r['intermediate']:5d} " \
            + " ".join(f"{r[f'{impl}_saved_bytes'] / 2**20:22.2f}" for impl in IMPLS) \
            + f" {r['formula_bytes'] / 2**20:12.2f}"
        if timed:
            line += (f" {r['grouped_fwd_bwd_ms']:11.2f} {r['memory_efficient_fwd_bwd_ms']:11.2f}"
                     f" {r['time_ratio_memory_efficient_to_grouped']:6.3f}")
        lines.append(line)
    return "\n".join(lines)


@dataclass
class MoeBenchOptions(BenchConfig):
    """Expert implementations side by side: saved bytes for backward and fwd+bwd time, same inputs."""

    # fine, coarse or qwen3_moe_debug: the defaults of tokens, hidden, intermediate, n_experts and top_k. Read
    # before the other options, because the preset decides the defaults they override.
    preset: str = "fine"
    json: Path | None = None  # write the results as JSON here
    sweep: bool = False  # also sweep granularity at constant top_k*intermediate; writes PNG + JSON to --out-dir
    out_dir: Path = RESULTS_DIR  # where the sweep writes
    sweep_bytes_only: bool = False  # do not time the sweep, only measure bytes
    backend_comparison: bool = True  # also time the non-chosen grouped GEMM backend (CPU, not float64)


def parse_options(argv: list[str]) -> MoeBenchOptions:
    """The command line as options: the preset's values as defaults, then the given overrides."""
    preset, rest = take_option(argv, "preset")
    preset = "fine" if preset is None else preset
    if preset not in PRESETS:
        raise ConfigError(f"--preset = {preset!r} is invalid: valid presets are {', '.join(PRESETS)}")
    default = MoeBenchOptions(preset=preset, **PRESETS[preset])
    return parse_typed_args(MoeBenchOptions, rest, PROG, default=default, bool_flags=True)


def bench_config(opts: MoeBenchOptions) -> BenchConfig:
    """The benchmark's shape and measurement settings (the JSON's "config"), validated."""
    cfg = BenchConfig(**{f.name: getattr(opts, f.name) for f in dataclasses.fields(BenchConfig)})
    _validate(cfg)
    return cfg


def main(argv: list[str]) -> int:
    opts = parse_options(argv)
    cfg = bench_config(opts)
    for name in ("json", "out_dir"):
        if getattr(opts, name) is not None:
            check_output_path(getattr(opts, name), f"--{name}")
    torch.manual_seed(cfg.seed)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    # As `moetrain train` runs one process: freed heap memory is reused, not returned to the kernel. Without
    # it every pass paid fresh pages for its gradients and temporaries (qwen3_moe_debug, bf16, one thread:
    # memory_efficient 505 -> 294 ms), a cost the trainer does not pay.
    reused = reuse_freed_host_memory(1)
    report = run_preset(cfg, compare_backends=opts.backend_comparison and cfg.device == "cpu"
                        and cfg.dtype != "float64")
    report = {"preset": opts.preset, "freed_memory_reused": reused, **report}
    print(f"moetrain bench moe --preset {opts.preset}: tokens={cfg.tokens} hidden={cfg.hidden} "
          f"intermediate={cfg.intermediate} experts={cfg.n_experts} top_k={cfg.top_k} {cfg.activation} {cfg.dtype} "
          f"{cfg.device} threads={torch.get_num_threads()} clock={cfg.clock} "
          f"(median of {cfg.repeats} after {cfg.warmup} warm-up; freed memory reused: {reused})")
    print(format_table(report))
    if opts.sweep:
        rows = run_sweep(cfg, timed=not opts.sweep_bytes_only)
        report["sweep"] = rows
        opts.out_dir.mkdir(parents=True, exist_ok=True)
        png, sweep_json = opts.out_dir / "bench_moe_granularity.png", opts.out_dir / "bench_moe_granularity.json"
        plot_sweep(rows, png)
        sweep_json.write_text(json.dumps({"preset": opts.preset, "config": dataclasses.asdict(cfg),
                                          "sweep": rows}, indent=2) + "\n")
        print(f"granularity sweep (tokens={cfg.tokens}, hidden={cfg.hidden}, top_k*intermediate=1024):")
        print(format_sweep(rows))
        print(f"wrote {png} and {sweep_json}")
    if opts.json is not None:
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {opts.json}")
    return 0
