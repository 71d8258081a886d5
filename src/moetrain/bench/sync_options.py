"""`moetrain bench sync` options: the dataclass the CLI parses, the mode table, and their validation.

`MODE_SETUP` says which mesh each bench mode runs on and which `grad_sync` policy it
uses; `REFERENCE` is the mode every ratio is relative to. This module only describes
and checks options: it must not import torch, build models or run anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from moetrain.args import check_output_path
from moetrain.bench.costs import CostSpec
from moetrain.errors import ConfigError

# bench mode -> (dp_replicate of the mesh it runs on: "R" = the bench's replicate size, or 1; grad_sync policy)
MODE_SETUP: dict[str, tuple[str, str]] = {
    "fsdp": ("1", "every_microbatch"),
    "hsdp": ("R", "every_microbatch"),
    "hsdp-delayed": ("R", "delayed_all_reduce"),
    "hsdp-final-only": ("R", "final_only"),
}
REFERENCE = "hsdp-delayed"
PP_SCHEDULES = ("1F1B", "Interleaved1F1B")  # ZBV splits the backward, where the bench cannot set FSDP's flags


@dataclass
class SyncBenchOptions:
    """Compare fsdp / hsdp / hsdp-delayed / hsdp-final-only step times on identical drawn microbatch costs."""

    cost_model: Literal["sleep", "batch", "packed"] = "sleep"
    # sleep: seconds of compute per microbatch; batch: samples per microbatch (rounded, >= 1);
    # packed: tokens per document of the microbatch's packed sequence (rounded, >= 1).
    cost: CostSpec = field(default_factory=lambda: CostSpec("bimodal", 0.04, 4.0, 0.5))
    replicate: int = 2  # replica groups (dp_replicate)
    shard: int = 2  # ranks per replica group (dp_shard)
    accum: int = 4  # microbatches per optimizer step
    steps: int = 16  # measured cost draws; each runs once in every mode
    warmup_steps: int = 1  # extra draws run first in every mode and discarded
    modes: tuple[str, ...] = tuple(MODE_SETUP)
    layers: int = 4  # FSDP units of the benchmark MLP
    dim: int = 64  # model width
    hidden: int = 256  # MLP / feed-forward hidden width
    seq_len: int = 16  # tokens per sample (sleep, batch)
    microbatch_size: int = 2  # samples per microbatch in the sleep model
    packed_tokens: int = 2048  # packed: tokens per microbatch (documents x document length, about this many)
    heads: int = 2  # packed: attention heads of the moetrain Transformer
    # The PP variant: pipeline ranks (world = pp x replicate x shard); each replica group is one pipeline of
    # `pp` ranks running torch's schedule over the accum microbatches, the MLP's layers split evenly over
    # its pp x pp_stages_per_rank stages. hsdp-final-only is torch's own stage (what moetrain trains with).
    pp: int = 1
    pp_schedule: str = "1F1B"  # 1F1B or Interleaved1F1B (2+ stages per rank)
    pp_stages_per_rank: int = 1
    seed: int = 0
    bootstrap: int = 2000  # paired bootstrap resamples for confidence intervals
    json: str | None = None
    figure: str | None = "auto"  # PNG path; "auto" = benchmarks/results/sync_<model>_<dist>_<R>x<S>_acc<A>.png; "none"
    timeout_s: float = 1200.0  # spawned ranks only: fail instead of hanging
    # Instead of running: read these bench JSON files, print a markdown table of measured vs
    # predicted ratios and draw them into --figure (default benchmarks/results/sync_summary.png).
    summarize: tuple[str, ...] = ()


def validate_options(opts: SyncBenchOptions) -> None:
    """Raise a one-line ConfigError for the first invalid option (before any rank is spawned)."""
    for name in ("replicate", "shard", "accum", "steps", "layers", "dim", "hidden", "seq_len", "microbatch_size",
                 "packed_tokens", "heads", "bootstrap", "pp", "pp_stages_per_rank"):
        if getattr(opts, name) < 1:
            raise ConfigError(f"{name} = {getattr(opts, name)!r} is invalid: must be a positive integer")
    if opts.warmup_steps < 0:
        raise ConfigError(f"warmup_steps = {opts.warmup_steps!r} is invalid: must be >= 0")
    if opts.seed < 0:  # numpy's generators (the drawn costs) take seeds >= 0
        raise ConfigError(f"seed = {opts.seed} is invalid: must be >= 0")
    if opts.timeout_s <= 0:
        raise ConfigError(f"timeout_s = {opts.timeout_s!r} is invalid: must be > 0 seconds")
    for name in ("json", "figure"):
        if getattr(opts, name) not in (None, "", "auto", "none"):
            check_output_path(getattr(opts, name), f"--{name}")
    if opts.cost_model not in ("sleep", "batch", "packed"):
        raise ConfigError(f"cost_model = {opts.cost_model!r} is invalid: valid are ('sleep', 'batch', 'packed')")
    if opts.cost_model == "packed" and (opts.dim % opts.heads or (opts.dim // opts.heads) % 2):
        raise ConfigError(f"heads = {opts.heads} is invalid: dim / heads must be an even integer (dim = {opts.dim})")
    unknown = [m for m in opts.modes if m not in MODE_SETUP]
    if unknown or not opts.modes:
        raise ConfigError(f"modes {list(opts.modes)} are invalid: choose from {tuple(MODE_SETUP)}")
    if REFERENCE not in opts.modes:
        raise ConfigError(f"modes {list(opts.modes)} must include {REFERENCE!r} (ratios are relative to it)")
    opts.cost.validate()
    if opts.pp > 1:
        if opts.cost_model != "sleep":
            raise ConfigError(f"cost_model = {opts.cost_model!r} is invalid with pp = {opts.pp}: pipeline stages "
                              "exchange fixed-shape activations, so only the sleep model varies a microbatch's cost")
        if opts.pp_schedule not in PP_SCHEDULES:
            raise ConfigError(f"pp_schedule = {opts.pp_schedule!r} is invalid: the bench sets the sync flags around "
                              f"full backwards, valid are {PP_SCHEDULES}")
        if opts.layers % (opts.pp * opts.pp_stages_per_rank):
            raise ConfigError(f"layers = {opts.layers} is invalid: must split evenly over pp x pp_stages_per_rank = "
                              f"{opts.pp * opts.pp_stages_per_rank} stages")
