"""The optimizer (AdamW, or Muon with AdamW beside it) over parameter groups, and the learning-rate schedule.

Every parameter belongs to one group of `moetrain.config.train.PARAM_GROUPS` (`param_group`: router,
experts, attention, dense_ffn, embeddings, head, norms), whose multipliers scale the learning rate
and weight decay (`train.lr_scale`, `train.weight_decay_scale`). Under `train.optimizer = "muon"` the
matrices of `train.muon_groups` take Muon (`moetrain.train.muon`); every 1-D parameter, the stacked
expert biases and the other groups take AdamW. The default leaves out the router (its rows are the
experts' score directions: orthogonalizing its update moves a rarely chosen expert's scores as fast
as a busy one's, noise included), the embeddings and the head (a lookup table and the logit layer,
not maps between hidden states: Muon's authors and Moonlight keep them on AdamW). Parameters with
the same optimizer, rate multiplier and weight decay share one torch param group.

Weight decay pulls weights toward zero; for norm gains, biases and embedding rows
that is a prior we do not want (a norm gain's natural value is 1, an embedding row
of a rare token would just decay away), so they go to a no-decay group unless
`train.decay_norms_and_embeddings` is set. The schedule is a pure function of the
step (warmup, then cosine / warmup-stable-decay / constant), so its only state is
the step counter, which the checkpoint already holds. This module does not step,
clip or synchronise anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from moetrain.config.train import TrainConfig
from moetrain.dtypes import DTYPES
from moetrain.model.moe import RoutedExpertWeights
from moetrain.train.muon import Muon, MuonSettings


def split_decay_groups(model: nn.Module, decay_norms_and_embeddings: bool) -> tuple[list[str], list[str]]:
    """Names of (decayed, not decayed) trainable parameters.

    Not decayed: every parameter with fewer than 2 dims (norm gains, biases, sinks), the
    stacked per-expert biases a module names in `bias_names` (2-D [E, width], still
    biases), and every nn.Embedding weight. A weight tied to an embedding is the same
    Parameter, so it follows the embedding.
    """
    embedding_params = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    stacked_biases = {id(getattr(m, name)) for m in model.modules()
                      for name in getattr(m, "bias_names", ()) if getattr(m, name, None) is not None}
    decay, no_decay = [], []
    seen: set[int] = set()
    for name, param in model.named_parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        exempt = param.ndim < 2 or id(param) in embedding_params or id(param) in stacked_biases
        (no_decay if exempt and not decay_norms_and_embeddings else decay).append(name)
    return decay, no_decay


def _fused_supported(params: list[nn.Parameter]) -> bool:
    # Fused AdamW runs on CPU and accelerators for floating-point params; a
    # single-kernel step is faster and deterministic, so prefer it where it exists.
    devices = set(_get_fused_kernels_supported_devices())
    return all(p.device.type in devices and torch.is_floating_point(p) for p in params)


def param_group(name: str) -> str:
    """The PARAM_GROUPS entry of the parameter called `name` (by the module names moetrain's models use).

    A parameter outside the named modules (block and final norms, anything new) is in "norms":
    base rates, AdamW.
    """
    parts = name.split(".")
    if parts[0] == "tok_embeddings":
        return "embeddings"
    if parts[0] == "output":
        return "head"
    if "attention" in parts:
        return "attention"
    if "router" in parts or "shared_expert_gate" in parts:
        return "router"
    if "experts" in parts:
        return "experts"
    if "feed_forward" in parts or "shared_expert" in parts:
        return "dense_ffn"
    return "norms"


def _muon_matrices(model: nn.Module, cfg: TrainConfig) -> dict[str, int]:
    """{name: column blocks} of the parameters Muon updates: the weight matrices (and expert stacks) of
    train.muon_groups; a fused gate | up expert weight holds 2 matrices side by side."""
    if cfg.optimizer != "muon":
        return {}
    blocks = {}
    for module_name, module in model.named_modules():
        if isinstance(module, RoutedExpertWeights):
            prefix = f"{module_name}." if module_name else ""
            blocks[prefix + "w1"] = module.w1.shape[-1] // module.w2.shape[-2]
    stacked_biases = {id(getattr(m, b)) for m in model.modules() for b in getattr(m, "bias_names", ())
                      if getattr(m, b, None) is not None}
    chosen = {}
    for name, param in model.named_parameters():
        if (param.requires_grad and param_group(name) in cfg.muon_groups and param.ndim in (2, 3)
                and id(param) not in stacked_biases):
            chosen[name] = blocks.get(name, 1)
    return chosen


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW (`train.optimizer = "adamw"`) or Muon with AdamW beside it, over the per-group rates."""
    named = dict(model.named_parameters())
    decay, no_decay = split_decay_groups(model, cfg.decay_norms_and_embeddings)
    muon = _muon_matrices(model, cfg)
    by_settings: dict[tuple[bool, float, float], list[nn.Parameter]] = {}
    for decayed, names in ((True, decay), (False, no_decay)):
        for name in names:
            group = param_group(name)
            weight_decay = cfg.weight_decay * cfg.weight_decay_scale.of(group) if decayed else 0.0
            by_settings.setdefault((name in muon, cfg.lr_scale.of(group), weight_decay), []).append(named[name])
    groups = [{"params": params, "muon": on_muon, "lr_scale": scale, "lr": cfg.lr * scale, "weight_decay": decay_}
              for (on_muon, scale, decay_), params in by_settings.items()]
    fused = True if _fused_supported([p for g in groups if not g["muon"] for p in g["params"]]) else None
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused)
    settings = MuonSettings(cfg.muon_momentum, cfg.muon_nesterov, cfg.muon_ns_steps, DTYPES[cfg.muon_ns_dtype])
    return Muon(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, settings=settings,
                column_blocks={named[n]: b for n, b in muon.items() if b > 1}, fused=fused)


@dataclass(frozen=True)
class LRSchedule:
    """lr(step) for step = 0, 1, ... (the number of optimizer steps already taken)."""

    peak_lr: float
    total_steps: int
    warmup_steps: int
    kind: str = "cosine"
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2

    @classmethod
    def from_config(cls, cfg: TrainConfig) -> LRSchedule:
        return cls(cfg.lr, cfg.steps, cfg.warmup_steps, cfg.schedule, cfg.min_lr_ratio, cfg.decay_fraction)

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        floor = self.min_lr_ratio
        if self.kind == "constant":
            return 1.0
        if self.kind == "cosine":
            span = max(1, self.total_steps - self.warmup_steps)
            progress = min(1.0, (step - self.warmup_steps) / span)
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        if self.kind == "wsd":
            # Warmup-stable-decay: hold the peak, then decay linearly to the floor over
            # the last decay_fraction of all steps.
            decay_steps = max(1, round(self.decay_fraction * self.total_steps))
            decay_start = max(self.warmup_steps, self.total_steps - decay_steps)
            if step < decay_start:
                return 1.0
            progress = min(1.0, (step - decay_start) / max(1, self.total_steps - decay_start))
            return 1.0 - (1 - floor) * progress
        raise ValueError(f"unknown schedule {self.kind!r}")

    def lr(self, step: int) -> float:
        return self.peak_lr * self.factor(step)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every group's rate: `lr` times the group's multiplier (train.lr_scale)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
