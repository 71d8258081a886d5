"""Optimizer groups, decoupled weight decay and the learning-rate schedules against closed forms."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from moetrain.config.moe import MoEConfig
from moetrain.config.train import TrainConfig
from moetrain.model.moe import RoutedExpertWeights
from moetrain.train.optim import LRSchedule, build_optimizer, set_lr, split_decay_groups


class Tiny(nn.Module):
    def __init__(self, tie: bool = False):
        super().__init__()
        self.tok_embeddings = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4, bias=True)
        self.norm = nn.RMSNorm(4)
        self.output = nn.Linear(4, 10, bias=False)
        self.frozen = nn.Parameter(torch.ones(3, 3), requires_grad=False)
        if tie:
            self.output.weight = self.tok_embeddings.weight


def test_norms_biases_and_embeddings_are_not_decayed_by_default():
    decay, no_decay = split_decay_groups(Tiny(), decay_norms_and_embeddings=False)
    assert decay == ["proj.weight", "output.weight"]
    assert no_decay == ["tok_embeddings.weight", "proj.bias", "norm.weight"]
    decay, no_decay = split_decay_groups(Tiny(), decay_norms_and_embeddings=True)
    assert no_decay == [] and len(decay) == 5


def test_tied_head_follows_the_embedding_and_is_listed_once():
    decay, no_decay = split_decay_groups(Tiny(tie=True), decay_norms_and_embeddings=False)
    assert decay == ["proj.weight"] and no_decay == ["tok_embeddings.weight", "proj.bias", "norm.weight"]


def test_weight_decay_is_decoupled_and_only_on_the_decay_group():
    torch.manual_seed(0)
    model = Tiny()
    cfg = TrainConfig(lr=0.1, weight_decay=0.5)
    opt = build_optimizer(model, cfg)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # Adam's update is exactly 0 for a zero gradient
    opt.step()
    # Decoupled decay: p <- p * (1 - lr * wd), independent of the gradient.
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        factor = 1 - 0.1 * 0.5 if name in ("proj.weight", "output.weight") else 1.0
        torch.testing.assert_close(p.detach(), before[name] * factor, rtol=0, atol=1e-7)


def test_fused_adamw_is_used_on_cpu_and_lr_can_be_set():
    opt = build_optimizer(Tiny(), TrainConfig())
    assert opt.defaults["fused"] is True
    set_lr(opt, 0.123)
    assert all(g["lr"] == 0.123 for g in opt.param_groups)


def test_warmup_then_cosine_closed_form():
    s = LRSchedule(peak_lr=1.0, total_steps=110, warmup_steps=10, kind="cosine", min_lr_ratio=0.1)
    assert [s.lr(i) for i in range(3)] == pytest.approx([0.1, 0.2, 0.3])
    assert s.lr(9) == pytest.approx(1.0)
    assert s.lr(10) == pytest.approx(1.0)
    assert s.lr(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert s.lr(110) == pytest.approx(0.1) and s.lr(500) == pytest.approx(0.1)


def test_wsd_holds_then_decays_linearly_to_the_floor():
    s = LRSchedule(peak_lr=2.0, total_steps=100, warmup_steps=5, kind="wsd", min_lr_ratio=0.0, decay_fraction=0.2)
    assert s.lr(4) == pytest.approx(2.0) and s.lr(50) == 2.0 and s.lr(79) == 2.0
    assert s.lr(80) == pytest.approx(2.0) and s.lr(90) == pytest.approx(1.0) and s.lr(100) == pytest.approx(0.0)


def test_constant_and_no_warmup():
    s = LRSchedule(peak_lr=0.5, total_steps=10, warmup_steps=0, kind="constant")
    assert {s.lr(i) for i in range(12)} == {0.5}
    with pytest.raises(ValueError, match="unknown schedule"):
        LRSchedule(1.0, 10, 0, kind="linear").lr(3)


def test_stacked_expert_biases_are_not_decayed():
    experts = RoutedExpertWeights(4, MoEConfig(n_experts=3, top_k=1, expert_hidden=2, expert_proj_bias=True))
    decay, no_decay = split_decay_groups(experts, decay_norms_and_embeddings=False)
    assert decay == ["w1", "w2"] and no_decay == ["b1", "b2"]
    without = RoutedExpertWeights(4, MoEConfig(n_experts=3, top_k=1, expert_hidden=2))
    assert split_decay_groups(without, decay_norms_and_embeddings=False) == (["w1", "w2"], [])
