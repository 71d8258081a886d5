"""AdamW with decoupled weight decay on the right parameters, and the learning-rate schedule.

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


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    named = dict(model.named_parameters())
    decay, no_decay = split_decay_groups(model, cfg.decay_norms_and_embeddings)
    groups = [{"params": [named[n] for n in decay], "weight_decay": cfg.weight_decay},
              {"params": [named[n] for n in no_decay], "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    params = [p for g in groups for p in g["params"]]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             fused=True if _fused_supported(params) else None)


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
    for group in optimizer.param_groups:
        group["lr"] = lr
