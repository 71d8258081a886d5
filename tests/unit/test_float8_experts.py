"""train.float8's routed experts (moetrain.model.float8_grouped_mm): every grouped GEMM within float8's error bound.

The recipe is torchao's rowwise float8 grouped one: e4m3 operands (u = 2^-4, subnormal spacing 2η = 2^-9,
max 448) with power-of-two scales per row of a product's left operand, per expert and column of its right
operand, and per expert and column of both weight-gradient operands. Each scale is at least
max / (2·amax of its slice), and a slice's amax is at most the amax of the expert's block, so test_float8's
elementwise bound `gemm_bound` (derived there and in docs/design/float8.md), applied to each expert's block of
each GEMM, bounds the float8 product against the exact product of the operands the GEMM received:

    |C_fp8 − C| <= ((1+u)^2 − 1 + 2^-8 + K·2^-24)·(|A||B|) + δa(1+u)·(1|B|) + δb(1+u)·(|A|1) + K·δa·δb

(δ = 2η·amax / 448 per operand; 2^-8 the bf16 rounding of the result, K·2^-24 the float32 sums). Every GEMM of
the expert layer, forward and backward (two products, two input-gradient products, two weight gradients),
is recorded as it runs inside the layer, for the standard-autograd and the memory-efficient implementations.
The error must also be float8-sized: a GEMM left in bf16 errs by at most 2^-8·|C| <= u/16·(|A||B|), so an
expert layer that was not converted fails; with every scale 8x too large (values saturate) the bound fails.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from test_float8 import E4M3, MOE_CFG, gemm_bound, tiny_model

from moetrain.model import float8_grouped_mm as f8
from moetrain.model import moe_function
from moetrain.model.experts import routed_experts
from moetrain.model.routing import routing_from_topk
from moetrain.parallel.float8 import convert_to_float8

pytest.importorskip("torchao.float8")
from torchao.float8 import float8_utils  # noqa: E402  # after the skip: the optional extra

T, D, E, K, N = 48, 32, 4, 2, 16


def record_gemms(monkeypatch) -> list[tuple[str, torch.Tensor, torch.Tensor, list[int], torch.Tensor]]:
    """Every float8 grouped GEMM the expert layer runs: (kind, a, b or g, group sizes, result)."""
    calls = []
    real_mm, real_grad = f8.float8_grouped_mm, f8.float8_grouped_mm_weight_grad

    def mm(a, b, counts, *args, **kwargs):
        result = real_mm(a, b, counts, *args, **kwargs)
        calls.append(("product", a.detach().clone(), b.detach().clone(), counts.tolist(), result.detach().clone()))
        return result

    def grad(a, g, counts, *args, **kwargs):
        result = real_grad(a, g, counts, *args, **kwargs)
        calls.append(("weight_grad", a.detach().clone(), g.detach().clone(), counts.tolist(),
                      result.detach().clone()))
        return result

    for module in (f8, moe_function):  # the grouped impl reaches them through f8, the memory-efficient one directly
        monkeypatch.setattr(module, "float8_grouped_mm", mm)
        monkeypatch.setattr(module, "float8_grouped_mm_weight_grad", grad)
    return calls


def expert_step(impl: str, float8: bool = True, device: str = "cpu") -> None:
    """One bf16 forward and backward of a routed-expert layer (some experts empty or nearly)."""
    gen = torch.Generator().manual_seed(0)

    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device, torch.bfloat16).requires_grad_()

    x, w1, w2 = leaf(T, D), leaf(E, D, 2 * N, scale=D**-0.5), leaf(E, N, D, scale=N**-0.5)
    logits = torch.randn(T, E, generator=gen) + torch.tensor([2.0, 0.0, -1.0, -4.0])  # unequal loads
    gates, idx = logits.softmax(-1).topk(K)
    routing = routing_from_topk(idx.to(device), gates.to(device, torch.bfloat16), E)
    out = routed_experts(x, routing, w1, w2, "swiglu", impl, float8=float8)
    (out.float() * torch.randn(T, D, generator=gen).to(device)).sum().backward()


def gemm_errors(calls) -> list[tuple[str, float, float]]:
    """(kind, max |err| / bound, max |err| / (u·|A||B|)) per expert block of every recorded GEMM."""
    rows = []
    for kind, a, b, sizes, result in calls:
        starts = [sum(sizes[:e]) for e in range(len(sizes))]
        for expert, (start, size) in enumerate(zip(starts, sizes, strict=True)):
            if size == 0:
                continue
            if kind == "product":
                left, right, got = a[start:start + size], b[expert], result[start:start + size]
            else:
                left, right, got = a[start:start + size].t(), b[start:start + size], result[expert]
            exact = left.double() @ right.double()
            err = (got.double() - exact).abs()
            first_order = E4M3[0] * (left.double().abs() @ right.double().abs())
            rows.append((kind, float((err / gemm_bound(left, right, E4M3, E4M3)).max()),
                         float((err / first_order.clamp_min(1e-30)).max())))
    return rows


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


@pytest.mark.parametrize("device", DEVICES)  # CUDA: torchao's kernels and torch._scaled_grouped_mm
@pytest.mark.parametrize("impl", ["grouped", "memory_efficient"])
def test_expert_gemms_within_the_float8_bound(impl, device, monkeypatch):
    calls = record_gemms(monkeypatch)
    expert_step(impl, device=device)
    assert sorted(kind for kind, *_ in calls) == ["product"] * 4 + ["weight_grad"] * 2
    rows = gemm_errors(calls)
    over = [r for r in rows if r[1] > 1]
    assert not over, f"float8 error beyond the bound: {over}"
    assert min(r[2] for r in rows if r[0] == "product") > 0.1, rows  # float8-sized, not bf16-sized
    assert min(r[2] for r in rows if r[0] == "weight_grad") > 0.1, rows


def test_wrong_scales_break_the_bound(monkeypatch):
    calls = record_gemms(monkeypatch)
    real = float8_utils.amax_to_scale
    monkeypatch.setattr(float8_utils, "amax_to_scale", lambda *a, **k: real(*a, **k) * 8)  # saturates
    expert_step("memory_efficient")
    assert max(r[1] for r in gemm_errors(calls)) > 1


def test_memory_efficient_chunks_cast_as_one(monkeypatch):
    """Every scale lies within one expert, so the memory-efficient layer's cache-sized chunks (one expert each)
    give the bits of one chunk over all experts, output and gradients."""
    results = []
    for chunk_rows in (0, 10**6):
        monkeypatch.setattr(moe_function, "CPU_CHUNK_ROWS", chunk_rows)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(T, D, generator=gen).bfloat16().requires_grad_()
        w1 = (torch.randn(E, D, 2 * N, generator=gen) / D**0.5).bfloat16().requires_grad_()
        w2 = (torch.randn(E, N, D, generator=gen) / N**0.5).bfloat16().requires_grad_()
        gates, idx = torch.randn(T, E, generator=gen).softmax(-1).topk(K)
        out = routed_experts(x, routing_from_topk(idx, gates.bfloat16(), E), w1, w2, "swiglu", "memory_efficient",
                             backend="segment_loop", float8=True)
        out.float().square().sum().backward()
        results.append([out, x.grad, w1.grad, w2.grad])
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)


def test_loop_refuses_float8():
    from moetrain.errors import ModelError

    with pytest.raises(ModelError, match="moe impl = grouped or memory_efficient"):
        expert_step("loop")


@pytest.mark.parametrize("impl, in_float8", [("memory_efficient", True), ("grouped", True), ("loop", False)])
def test_which_experts_run_in_float8(impl, in_float8, caplog):
    """The MoE layer's experts convert (plain parameters, the same state dict), the loop's stay high precision,
    and the one log line says which."""
    cfg = dataclasses.replace(MOE_CFG, moe=dataclasses.replace(MOE_CFG.moe, impl=impl))
    model = tiny_model(cfg)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with caplog.at_level(logging.INFO, logger="moetrain"):
        plan = convert_to_float8(model, "tensorwise")
    moe = model.layers[1].moe
    assert moe.expert_float8 is in_float8
    assert (plan.experts, plan.experts_by_impl) == ((["layers.1.moe"], []) if in_float8 else ([], ["layers.1.moe"]))
    assert all(type(p) is torch.nn.Parameter for p in moe.experts.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("float8 tensorwise"))
    assert f"the routed experts of {1 if in_float8 else 0} MoE layers in float8 grouped GEMMs" in line
    assert ("the routed experts of 1 MoE layers (moe.impl = loop)" in line) is not in_float8


def test_expert_widths_not_multiples_of_16_stay_high_precision():
    cfg = dataclasses.replace(MOE_CFG, moe=dataclasses.replace(MOE_CFG.moe, expert_hidden=24))
    plan = convert_to_float8(tiny_model(cfg), "rowwise")
    assert plan.experts == [] and "layers.1.moe.experts [4x32x24]" in plan.by_shape


def test_float8_model_trains_its_experts_in_float8(monkeypatch):
    """A converted model's forward and backward run the experts' GEMMs in float8 (and only with float8 asked)."""
    calls = record_gemms(monkeypatch)
    for recipe in ("none", "rowwise"):
        model = tiny_model(MOE_CFG)
        if recipe != "none":
            convert_to_float8(model, recipe)
        model.to(torch.bfloat16)(torch.randint(0, MOE_CFG.vocab_size, (2, 16))).float().mean().backward()
        assert len(calls) == (0 if recipe == "none" else 6)
