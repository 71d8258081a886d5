"""Muon on one process: torch.optim.Muon's update, the float64 closed form, expert stacks, groups and refusals.

- `orthogonalize` in bfloat16 is torch's `_zeropower_via_newtonschulz`, bit for bit (tall and wide).
- The optimizer in float64 with a bfloat16 iteration equals `torch.optim.Muon(adjust_lr_fn="match_rms_adamw")`
  over 3 steps, Nesterov or not, to 1e-10.
- With a float64 iteration the update is the closed form U·p⁵(Σ/‖u‖_F)·Vᵀ (p the quintic NS polynomial on
  each singular value, the singular vectors kept) at Moonlight's RMS-matched rate, to 1e-10.
- A gated expert stack [E, d, 2n] is 2E matrices: the same as torch's Muon on each expert's gate and up slice.
- build_optimizer: which parameters Muon takes, per-group rates reach the groups, AdamW's default groups as before.
- The CLI refuses a 1-D group on Muon, a negative τ and a NaN rate in one line with exit status 2.
"""

from __future__ import annotations

import pytest
import torch
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS, _zeropower_via_newtonschulz

from moetrain.cli import main
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.config.train import GroupScales, TrainConfig
from moetrain.model.transformer import Transformer
from moetrain.train.muon import Muon, MuonSettings, orthogonalize
from moetrain.train.optim import build_optimizer, set_lr

COEFFICIENTS = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
LR, WEIGHT_DECAY, MOMENTUM = 0.02, 0.1, 0.95


def _muon(params, ns_dtype=torch.float64, nesterov=True, column_blocks=None) -> Muon:
    return Muon([{"params": params, "muon": True, "weight_decay": WEIGHT_DECAY}], lr=LR, betas=(0.9, 0.95),
                eps=1e-8, settings=MuonSettings(MOMENTUM, nesterov, 5, ns_dtype), column_blocks=column_blocks)


@pytest.mark.parametrize("shape", [(12, 5), (5, 12), (8, 8)])
def test_orthogonalize_in_bfloat16_is_torchs_iteration_bit_for_bit(shape):
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    ours = orthogonalize(grad, 5, torch.bfloat16)
    torchs = _zeropower_via_newtonschulz(grad.clone(), COEFFICIENTS, 5, EPS)
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, torchs)


@pytest.mark.parametrize("nesterov", [True, False])
def test_update_equals_torch_muon_with_rms_matching(nesterov):
    gen = torch.Generator().manual_seed(0)
    shapes = [(16, 8), (8, 24), (12, 12)]
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    start = [p.detach().clone() for p in ours]
    optimizer = _muon(ours, ns_dtype=torch.bfloat16, nesterov=nesterov)
    reference = torch.optim.Muon(theirs, lr=LR, weight_decay=WEIGHT_DECAY, momentum=MOMENTUM, nesterov=nesterov,
                                 adjust_lr_fn="match_rms_adamw")
    for _ in range(3):
        for a, b in zip(ours, theirs, strict=True):
            a.grad = torch.randn(a.shape, generator=gen, dtype=torch.float64)
            b.grad = a.grad.clone()
        optimizer.step()
        reference.step()
    for a, b, a0 in zip(ours, theirs, start, strict=True):
        assert float((a - b).detach().abs().max()) < 1e-10
        assert float((a - a0).detach().abs().max()) > 1e-3


def _newton_schulz_closed_form(update: torch.Tensor) -> torch.Tensor:
    """U·p⁵(Σ/‖update‖_F)·Vᵀ: the quintic iteration acts on each singular value alone."""
    u, s, vh = torch.linalg.svd(update, full_matrices=False)
    x = s / update.norm()
    a, b, c = COEFFICIENTS
    for _ in range(5):
        x = a * x + b * x ** 3 + c * x ** 5
    return u @ torch.diag(x) @ vh


def test_float64_step_is_the_closed_form():
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(10, 6, generator=gen, dtype=torch.float64)
    grad = torch.randn(10, 6, generator=gen, dtype=torch.float64)
    param = torch.nn.Parameter(weight.clone())
    param.grad = grad.clone()
    _muon([param]).step()
    momentum = (1 - MOMENTUM) * grad  # the buffer after one step (EMA form, from zero)
    nesterov = (1 - MOMENTUM) * grad + MOMENTUM * momentum
    rate = LR * 0.2 * max(10, 6) ** 0.5  # Moonlight's RMS matching
    expected = weight * (1 - LR * WEIGHT_DECAY) - rate * _newton_schulz_closed_form(nesterov)
    assert float((param.detach() - expected).abs().max()) < 1e-10
    assert float((expected - weight).abs().max()) > 1e-3


def test_gated_expert_stack_is_its_gate_and_up_matrices():
    gen = torch.Generator().manual_seed(5)
    experts, dim, hidden = 3, 8, 5
    stack = torch.nn.Parameter(torch.randn(experts, dim, 2 * hidden, generator=gen, dtype=torch.float64))
    slices = [torch.nn.Parameter(stack.detach()[e, :, half * hidden:(half + 1) * hidden].clone())
              for e in range(experts) for half in range(2)]
    optimizer = _muon([stack], ns_dtype=torch.bfloat16, column_blocks={stack: 2})
    reference = torch.optim.Muon(slices, lr=LR, weight_decay=WEIGHT_DECAY, momentum=MOMENTUM,
                                 adjust_lr_fn="match_rms_adamw")
    for _ in range(2):
        stack.grad = torch.randn(stack.shape, generator=gen, dtype=torch.float64)
        for index, piece in enumerate(slices):
            e, half = divmod(index, 2)
            piece.grad = stack.grad[e, :, half * hidden:(half + 1) * hidden].clone()
        optimizer.step()
        reference.step()
    rebuilt = torch.stack([torch.cat([slices[2 * e].detach(), slices[2 * e + 1].detach()], dim=1)
                           for e in range(experts)])
    assert float((stack.detach() - rebuilt).abs().max()) < 1e-10


def test_muon_refuses_a_vector():
    with pytest.raises(ValueError, match="AdamW group"):
        _muon([torch.nn.Parameter(torch.zeros(4))])


MOE_MODEL = ModelConfig(vocab_size=32, dim=16, n_layers=2, n_dense_layers=1, n_heads=2, ffn_hidden=24, max_seq_len=8,
                        moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=8))


def _groups_by_name(optimizer, model) -> dict[str, dict]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: group for group in optimizer.param_groups for p in group["params"]}


def test_build_optimizer_puts_hidden_matrices_on_muon_and_the_rest_on_adamw():
    model = Transformer(MOE_MODEL)
    optimizer = build_optimizer(model, TrainConfig(optimizer="muon"))
    on_muon = {name for name, group in _groups_by_name(optimizer, model).items() if group["muon"]}
    assert on_muon == {f"layers.{i}.attention.{w}.weight" for i in range(2) for w in ("wq", "wk", "wv", "wo")} | {
        f"layers.0.feed_forward.{w}.weight" for w in ("w1", "w2", "w3")} | {"layers.1.moe.experts.w1",
                                                                           "layers.1.moe.experts.w2"}
    assert optimizer._column_blocks == {id(model.layers[1].moe.experts.w1): 2}  # SwiGLU's fused gate | up


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_per_group_rates_reach_every_group(optimizer):
    model = Transformer(MOE_MODEL)
    cfg = TrainConfig(optimizer=optimizer, lr_scale=GroupScales(router=0.5, embeddings=2.0),
                      weight_decay_scale=GroupScales(experts=0.0, attention=3.0))
    optimizer = build_optimizer(model, cfg)
    set_lr(optimizer, 0.01)
    groups = _groups_by_name(optimizer, model)
    assert groups["layers.1.moe.router.weight"]["lr"] == pytest.approx(0.005)
    assert groups["tok_embeddings.weight"]["lr"] == pytest.approx(0.02)
    assert groups["layers.0.attention.wq.weight"]["lr"] == pytest.approx(0.01)
    assert groups["layers.1.moe.experts.w1"]["weight_decay"] == 0.0
    assert groups["layers.0.attention.wq.weight"]["weight_decay"] == pytest.approx(0.3)
    assert groups["layers.0.attention_norm.weight"]["weight_decay"] == 0.0  # a norm: not decayed


def test_adamw_default_keeps_its_two_groups():
    optimizer = build_optimizer(Transformer(MOE_MODEL), TrainConfig())
    assert type(optimizer) is torch.optim.AdamW
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]


@pytest.mark.parametrize("override,field", [
    (["--train.optimizer", "muon", "--train.muon_groups", "norms"], "train.muon_groups"),
    (["--train.qk_clip_tau", "-1"], "train.qk_clip_tau"),
    (["--train.lr_scale.router", "nan"], "train.lr_scale.router"),
    (["--train.weight_decay_scale.head", "-2"], "train.weight_decay_scale.head"),
])
def test_cli_refuses_in_one_line(override, field, capsys):
    assert main(["train", "--config", "configs/tiny_moe.toml", *override]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and field in err
