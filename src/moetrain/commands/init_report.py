"""`moetrain init-report`: build the configured model on the CPU, initialise it, print intended vs measured.

`main(argv)` handles `moetrain init-report --config C --scheme S [--seed N] [--json]`: it
builds the model with the one builder (`moetrain.train.build`), initialised with a scheme of the
catalog (moetrain.model.init), and prints, per parameter
(fused expert weights: one row per half), the rule, the intended std and the measured std and
mean, as a table or as JSON. `report_rows` also works on an FSDP-sharded model (it gathers each
full tensor, a collective on every rank). It holds no init logic of its
own (the drawing lives in moetrain.model.init).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from moetrain.args import parse_typed_args
from moetrain.config.job import JobConfig, load
from moetrain.config.model import ModelConfig
from moetrain.model.init import Scheme, canonical_name, classify, get_scheme, single_cpu_thread
from moetrain.model.transformer import Transformer
from moetrain.train.build import build_model

JSON_KEYS = ("name", "shape", "dist", "cutoff", "target_std", "measured_std", "measured_mean", "sigma", "kind",
             "numel", "max_abs")


@dataclass
class Options:
    """Initialise the configured model on the CPU with a scheme and print, per parameter, intended vs
    measured std and mean."""

    config: str | None = None
    """TOML job config; None: the built-in defaults"""
    scheme: str | None = None
    """init scheme name (llama, gpt2, ...; docs/init.md); None: the config's model.init_scheme"""
    seed: int | None = None
    """init seed; None: the config's train.seed"""
    json: bool = False
    """print a JSON list of per-parameter objects"""


def report_rows(model: nn.Module, scheme_name: str) -> list[dict]:
    """Intended vs measured distribution of every parameter (fused expert weights: one row per half)."""
    scheme = get_scheme(scheme_name, model.cfg.init_scale_embedding)
    rows = []
    with single_cpu_thread():
        _collect_rows(model, scheme, rows)
    return rows


def _collect_rows(model: nn.Module, scheme: Scheme, rows: list[dict]) -> None:
    for name, param in model.named_parameters():
        canonical = canonical_name(name)
        full = param.full_tensor() if isinstance(param, DTensor) else param
        full = full.detach().to(torch.float64)
        for seg in classify(canonical, model.cfg):
            rule = scheme.rule(seg.kind, model.cfg.tie_embeddings)
            kind = scheme.tied_weight_kind if model.cfg.tie_embeddings and seg.kind == "embedding" else seg.kind
            values = full if seg.col_start is None else full[..., seg.col_start:seg.col_end]
            cutoff = rule.cutoff(seg.dims)
            rows.append({
                "name": f"{canonical}[{seg.label}]" if seg.label else canonical,
                "kind": kind,
                "shape": list(values.shape),
                "numel": values.numel(),
                "dist": rule.dist,
                "rule": rule.describe(seg.dims),
                "sigma": rule.sigma(seg.dims) if rule.dist in ("normal", "trunc_normal") else 0.0,
                "cutoff": cutoff,
                "target_std": rule.target_std(seg.dims),
                "target_mean": rule.target_mean(),
                "measured_std": values.std().item() if values.numel() > 1 else 0.0,
                "measured_mean": values.mean().item(),
                "max_abs": values.abs().max().item(),
            })


def build_initialised(cfg: ModelConfig, scheme_name: str, seed: int = 0) -> Transformer:
    """A `Transformer(cfg)` built on meta, materialised on the CPU and initialised with a scheme."""
    get_scheme(scheme_name, cfg.init_scale_embedding)
    return build_model(cfg, seed=seed, init_scheme=scheme_name)


def _format_table(rows: list[dict], scheme: str) -> str:
    header = f"{'parameter':44} {'shape':16} {'distribution':44} {'target_std':>10} {'std':>10} {'mean':>10}"
    lines = [f"init scheme {scheme!r}", header, "-" * len(header)]
    for row in rows:
        shape = "x".join(str(s) for s in row["shape"])
        lines.append(f"{row['name']:44} {shape:16} {row['rule']:44} {row['target_std']:10.5f} "
                     f"{row['measured_std']:10.5f} {row['measured_mean']:10.5f}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """`moetrain init-report --config C --scheme S [--seed N] [--json]`; returns the exit status."""
    options = parse_typed_args(Options, argv, "moetrain init-report", bool_flags=True)
    cfg = load(options.config) if options.config else JobConfig().validate()
    scheme = options.scheme or cfg.model.init_scheme
    get_scheme(scheme, cfg.model.init_scale_embedding)
    seed = cfg.train.seed if options.seed is None else options.seed
    rows = report_rows(build_initialised(cfg.model, scheme, seed), scheme)
    if options.json:
        json.dump([{k: row[k] for k in JSON_KEYS} for row in rows], sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        print(_format_table(rows, scheme))
    return 0
