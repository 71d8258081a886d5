"""train.float8 (moetrain.parallel.float8): each float8 linear's output and gradients within float8's error bound.

The bound (docs/design/float8.md). A float8 cast of x with scale s rounds x·s to the nearest float8 value:
for a normal result the relative error is at most u = 2^-(m+1) (m mantissa bits: e4m3 u = 2^-4, e5m2
u = 2^-3); below the smallest normal the absolute error is at most half the subnormal spacing, η/s
(e4m3 η = 2^-10, e5m2 η = 2^-17). torchao's dynamic scale is s = max_fp8 / amax (rowwise: rounded down to a
power of two, so s >= max_fp8 / (2·amax)), hence |q(x) − x| <= u|x| + δ with δ = 2η·amax / max_fp8.
A product of two cast operands then errs by at most |a||b|((1+ua)(1+ub) − 1) + δa|b|(1+ub) + δb|a|(1+ua)
+ δaδb, and a K-long dot product by the sum of these over k: elementwise, with |A| and |B| the absolute
matrices (float64),

    |C_fp8 − C| <= ((1+ua)(1+ub) − 1)·(|A||B|) + δa(1+ub)·(1|B|) + δb(1+ua)·(|A|1) + K·δa·δb
                   + (2^-8 + K·2^-24)·(|A||B|)          (the bf16 output rounding, the float32 sums)

where C is the exact product of the high-precision operands the linear received. The worst case is
reached only when all K rounding errors line up; the typical error is ~√K times smaller, so the test also
asks that the error be float8-sized (a linear left in bf16 errs at most 1/16 as much), which catches a model that
was not converted at all. With the scale wrong (8x too large, so values saturate) the bound fails.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from torch import nn

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.model.transformer import Transformer
from moetrain.parallel.float8 import HIGH_PRECISION, convert_to_float8, plan_float8

pytest.importorskip("torchao.float8")
from torchao.float8 import float8_utils  # noqa: E402  # after the skip: the optional extra
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

E4M3 = (2.0**-4, 2.0**-10, 448.0)  # (u, η, max)
E5M2 = (2.0**-3, 2.0**-17, 57344.0)
# Per recipe: formats of (input, weight, grad_output) as torchao's recipes cast them.
FORMATS = {"tensorwise": (E4M3, E4M3, E5M2), "rowwise": (E4M3, E4M3, E4M3)}

# Every width a multiple of 16 (float8's requirement) but the dense FFN of the second config.
MOE_CFG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_dense_layers=1, n_heads=2, ffn_hidden=64, max_seq_len=16,
                      qk_norm="per_head", moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, n_shared_experts=2,
                                                        shared_expert_gate=True))
MLA_CFG = dataclasses.replace(MOE_CFG, ffn_hidden=40, kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=16,
                              qk_rope_head_dim=16, v_head_dim=16, qk_norm="none")


def tiny_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(cfg)
    model.init_weights(seed=seed)
    return model


def gemm_bound(a: torch.Tensor, b: torch.Tensor, fa: tuple, fb: tuple) -> torch.Tensor:
    """The elementwise bound above on |float8 product − exact product| of a [M, K] @ b [K, N] (float64)."""
    (ua, eta_a, max_a), (ub, eta_b, max_b) = fa, fb
    a, b = a.double().abs(), b.double().abs()
    da, db = 2 * eta_a * float(a.max()) / max_a, 2 * eta_b * float(b.max()) / max_b
    k = a.shape[1]
    ab = a @ b
    return (((1 + ua) * (1 + ub) - 1 + 2.0**-8 + k * 2.0**-24) * ab + da * (1 + ub) * b.sum(0, keepdim=True)
            + db * (1 + ua) * a.sum(1, keepdim=True) + k * da * db)


def record_linears(model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """Hooks keeping every Float8Linear's input, output, output gradient and input gradient of one step."""
    seen: dict[str, dict[str, torch.Tensor]] = {}
    for name, module in model.named_modules():
        if isinstance(module, Float8Linear):
            slot = seen.setdefault(name, {})
            module.register_forward_hook(lambda _m, args, out, s=slot: s.update(x=args[0].detach(), y=out.detach()))
            module.register_full_backward_hook(
                lambda _m, gin, gout, s=slot: s.update(gx=gin[0].detach(), gy=gout[0].detach()))
    return seen


def step_errors(recipe: str, emulate: bool) -> list[tuple[str, str, float, float]]:
    """(linear, gemm, max |err| / bound, max |err| / float8 scale of the bound) of one bf16 forward+backward."""
    model = tiny_model(MOE_CFG)
    convert_to_float8(model, recipe, device_type="cpu" if emulate else "cuda")  # "cuda": torch._scaled_mm itself
    model.to(torch.bfloat16)
    seen = record_linears(model)
    tokens = torch.randint(0, MOE_CFG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    model(tokens).float().square().mean().backward()
    f_in, f_w, f_go = FORMATS[recipe]
    rows = []
    for name, s in seen.items():
        weight = dict(model.named_modules())[name].weight
        x, gy = s["x"].reshape(-1, s["x"].shape[-1]), s["gy"].reshape(-1, s["gy"].shape[-1])
        w = weight.detach()
        checks = (("output", s["y"].reshape(gy.shape), x, w.t(), f_in, f_w),
                  ("grad_input", s["gx"].reshape(x.shape), gy, w, f_go, f_w),
                  ("grad_weight", weight.grad.t(), x.t(), gy, f_in, f_go))
        for gemm, got, a, b, fa, fb in checks:
            err = (got.double() - a.double() @ b.double()).abs()
            bound = gemm_bound(a, b, fa, fb)
            float8_scale = fa[0] * (a.double().abs() @ b.double().abs())  # the first-order float8 term alone
            rows.append((name, gemm, float((err / bound).max()),
                         float((err / float8_scale.clamp_min(1e-30)).max())))
    return rows


@pytest.mark.parametrize("recipe, emulate", [("tensorwise", True), ("rowwise", True), ("tensorwise", False),
                                             ("rowwise", False)])
def test_float8_linears_within_the_bound(recipe, emulate):
    rows = step_errors(recipe, emulate)
    assert len(rows) == 3 * len(plan_float8(tiny_model(MOE_CFG)).converted)
    over = [r for r in rows if r[2] > 1]
    assert not over, f"float8 error beyond the bound: {over}"
    # Float8-sized: every GEMM's largest error is a sizeable part of u·(|A||B|) (measured 0.36-1.4); a bf16
    # product of the same bf16 operands errs by at most 2^-8·|C| <= u/16·(|A||B|).
    assert min(r[3] for r in rows) > 0.1, rows


def test_wrong_scales_break_the_bound(monkeypatch):
    real = float8_utils.amax_to_scale
    monkeypatch.setattr(float8_utils, "amax_to_scale", lambda *a, **k: real(*a, **k) * 8)  # saturates
    rows = step_errors("tensorwise", emulate=True)
    assert max(r[2] for r in rows) > 1


def test_which_linears_run_in_float8(caplog):
    """Attention, dense FFN and shared expert convert; router, gate, head, MLA's low-rank ones and bad shapes do not."""
    with caplog.at_level(logging.INFO, logger="moetrain"):
        model = tiny_model(MLA_CFG)
        plan = convert_to_float8(model, "rowwise")
    converted = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert converted == set(plan.converted) == {
        "layers.0.attention.wq_b", "layers.0.attention.wo", "layers.1.attention.wq_b", "layers.1.attention.wo",
        "layers.1.moe.shared_expert.w1", "layers.1.moe.shared_expert.w2", "layers.1.moe.shared_expert.w3"}
    assert {n.rsplit(".", 1)[-1] for n in plan.by_name} == HIGH_PRECISION
    assert plan.by_shape == ["layers.0.feed_forward.w1 [40x32]", "layers.0.feed_forward.w2 [32x40]",
                             "layers.0.feed_forward.w3 [40x32]"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and all(s in warnings[0] for s in plan.by_shape)
    assert all(type(p) is nn.Parameter for p in model.layers[1].moe.experts.parameters())  # routed: high precision


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_state_dict_unchanged(recipe):
    """Same keys, shapes, dtypes and values as the model without float8: checkpoints and exports see no difference."""
    plain, converted = tiny_model(MOE_CFG), tiny_model(MOE_CFG)
    convert_to_float8(converted, recipe)
    a, b = plain.state_dict(), converted.state_dict()
    assert list(a) == list(b)
    for key in a:
        assert type(b[key]) is torch.Tensor and b[key].dtype == a[key].dtype and torch.equal(a[key], b[key]), key
    plain.load_state_dict(b)  # and back


def test_unknown_recipe_is_one_line():
    from moetrain.errors import ConfigError
    with pytest.raises(ConfigError, match=r"^train.float8 = 'mxfp8' is invalid: valid are none, tensorwise, rowwise$"):
        convert_to_float8(tiny_model(MOE_CFG), "mxfp8")


def float8_step(recipe: str, cfg: ModelConfig, **build) -> tuple[float, dict[str, torch.Tensor]]:
    """(loss, gradients) of one forward+backward of the float8 model built by build_model (float32 weights)."""
    from moetrain.train.build import build_model

    model = build_model(cfg, seed=0, float8=recipe, **build).train()
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, cfg.vocab_size),
                                             tokens[:, 1:].reshape(-1)) + model.aux_loss()
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


# Compile traces one dense block (tracing torchao's float8 tensors is the slow part; the MoE block's
# compile is tested without float8 in test_compile_and_checkpointing.py).
DENSE_CFG = dataclasses.replace(MOE_CFG, n_layers=1)


@pytest.mark.parametrize("recipe, cfg, build", [
    ("rowwise", DENSE_CFG, {"activation_checkpointing": "full", "compile": True}),
    ("tensorwise", MOE_CFG, {"activation_checkpointing": "selective"}),
    ("tensorwise", MOE_CFG, {"activation_checkpointing": "full", "activation_checkpointing_every": 2}),
])
def test_compile_and_checkpointing_compose(recipe, cfg, build, monkeypatch):
    """Recomputation casts the same values with the same scales, and compile traces torchao's float8 linears
    without a graph break (fullgraph): the loss and gradients of eager float8 without checkpointing."""
    from moetrain.parallel import parallelize

    monkeypatch.setattr(parallelize, "COMPILE_BACKEND", "aot_eager")  # tracing, not inductor's C++ build
    torch._dynamo.reset()
    loss_ref, grads_ref = float8_step(recipe, cfg)
    loss, grads = float8_step(recipe, cfg, **build)
    assert loss == pytest.approx(loss_ref, rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_ref[name], rtol=1e-5, atol=1e-7, msg=name)


def test_cli_refuses_an_unknown_recipe(tmp_path, capsys):
    from moetrain import cli

    config = tmp_path / "job.toml"
    config.write_text(f"[train]\nfloat8 = 'mxfp8'\n[logging]\nrun_dir = '{tmp_path / 'run'}'\n")
    assert cli.main(["train", "--config", str(config)]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines == ["moetrain: error: train.float8 = 'mxfp8' has the wrong type: expected one of 'none', "
                     "'tensorwise', 'rowwise'"]
    assert not (tmp_path / "run").exists()
