"""FP8 training through torchao: which linears run their matmuls in float8, and the scales FSDP gathers them with.

`convert_to_float8` swaps the chosen `nn.Linear`s of a model for torchao's `Float8Linear`
(`torchao.float8.convert_to_float8_training`), before any parallelism wraps the model (under pipeline parallelism
each stage part, which shares the rank's whole part's modules). A
`Float8Linear` keeps its high-precision `weight` (and `bias`) parameters under the same names and
dtypes; only its forward and backward cast the input, the weight and the output gradient to
float8 with dynamic scales (one per tensor for "tensorwise", one per row for "rowwise",
torchao's recipes) and multiply them with `torch._scaled_mm`. So the optimizer, checkpoints,
resume and the Hugging Face export see exactly the parameters they see without float8.

What runs in float8: the attention projections (wq, wk, wv, wo; MLA's wq / wq_b and wo), the
dense blocks' SwiGLU (w1, w2, w3), the shared experts' SwiGLU, and the routed experts' grouped GEMMs
(forward and backward) in torchao's rowwise float8 grouped recipe whatever the linears' recipe (the one
float8 grouped recipe torchao 0.18 has: `torchao.prototype.moe_training`, `Float8TrainingOpConfig`):
`MoE.expert_float8` hands the layer's expert computation `float8=True` (moetrain.model.float8_grouped_mm:
torchao's casts everywhere, torchao's kernels and `torch._scaled_grouped_mm` on CUDA, the scaled product
emulated elsewhere). The expert weights stay plain parameters (torchao's wrapper tensor intercepts
`torch._grouped_mm`, which the memory-efficient layer, one opaque operator, never hands its weights to) and
are gathered in `param_dtype`, as torchao's wrapper gathers them. What stays in `parallel.param_dtype`, by name
(`HIGH_PRECISION`):

- the router and the shared-expert gate (DeepSeek-V3's report keeps its MoE gating in high
  precision; a rounding of the router logits flips top-k choices), the output head (the same
  report, and torchtitan's float8 filter skips `output`); embeddings and norms are not linears;
- MLA's low-rank projections wq_a, wkv_a and wkv_b: at DeepSeek-V3's own sizes torchao's rowwise
  filter (`_auto_filter_for_rowwise`) rejects all three (output width <= 2048, or inner width <= 1024),
  so they stay high precision at every size, by name, and a debug preset converts what the full
  model converts;
- the routed experts under `moe.impl = "loop"`, the high-precision reference.

A linear whose width or height is not a multiple of 16 (`_scaled_mm`'s requirement), or an expert layer whose
model or hidden width is not (`_scaled_grouped_mm`'s), stays high precision too, and one log line lists
every such module.

Under FSDP with the tensorwise recipe the weights are all-gathered in float8
(`enable_fsdp_float8_all_gather`): each rank casts its shard with the scale of the whole weight, so
the gathered float8 weight is the one a single process would cast; `precompute_float8_scales`,
called after each optimizer step, computes every weight's scale with one all-reduce of the amaxes
instead of one per weight. Rowwise scales cannot be computed per shard, so rowwise gathers in
`param_dtype`. A float8-gathered weight is a storage-less torchao wrapper around its float32 shard, so a
state-dict hook on each such linear hands checkpoints the shard itself (`_plain_float8_weight`). Off CUDA the
GEMMs run in torchao's emulation (`NATIVE_ON`). This module changes how matmuls compute, never which parameters
exist or their names. torchao is an optional extra (moetrain[fp8]): it is imported only when float8 is asked for.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from types import ModuleType

from torch import nn
from torch.distributed.tensor import DTensor

from moetrain.errors import ConfigError
from moetrain.logging import get_logger
from moetrain.model.moe import MoE

log = get_logger("float8")

RECIPES = ("tensorwise", "rowwise")
# Linears that stay in high precision whatever their shape: the last component of their name.
HIGH_PRECISION = frozenset({"router", "shared_expert_gate", "output", "wq_a", "wkv_a", "wkv_b"})
# `torch._scaled_mm` needs both dimensions of the weight to be multiples of this.
ALIGNMENT = 16
# Devices whose float8 GEMMs run `torch._scaled_mm` itself. Elsewhere (CPU) torchao's `emulate` mode runs:
# the same float8 casts and scales, each GEMM as float32 products of the dequantized float8 operands.
# On this CPU (torch 2.13) `_scaled_mm` falls back to a kernel about a thousand times slower than a bf16
# matmul for some scale layouts (a tensorwise e4m3 x e4m3 256^3 product 2.2 s; a rowwise Float8Linear
# backward at 256 tokens x 256 x 256, 7.5 s), too slow to train even the default job.
NATIVE_ON = frozenset({"cuda"})


@dataclass
class Float8Plan:
    """Which linears a conversion turns to float8 and which it leaves high precision, and why."""

    converted: list[str] = field(default_factory=list)
    by_name: list[str] = field(default_factory=list)
    by_shape: list[str] = field(default_factory=list)  # "name [out x in]", or "name [E x d x n]" for experts
    experts: list[str] = field(default_factory=list)  # MoE layers whose routed experts run in float8
    experts_by_impl: list[str] = field(default_factory=list)  # ... that stay high precision: moe.impl = "loop"


def _torchao_float8() -> ModuleType:
    try:
        import torchao.float8  # the optional extra
    except ImportError as error:
        raise ConfigError(f"train.float8 needs torchao (pip install 'moetrain[fp8]'): {error}") from None
    return torchao.float8


def float8_config(recipe: str, float8_all_gather: bool, emulate: bool):
    """torchao's Float8LinearConfig of `recipe`; float8 all-gather where the recipe allows it (tensorwise);
    `emulate`: torchao's emulation of the float8 GEMMs (float8 operands, float32 products)."""
    if recipe not in RECIPES:
        raise ConfigError(f"train.float8 = {recipe!r} is invalid: valid are none, {', '.join(RECIPES)}")
    config = _torchao_float8().Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, enable_fsdp_float8_all_gather=float8_all_gather and recipe == "tensorwise",
                               emulate=emulate)


def plan_float8(model: nn.Module) -> Float8Plan:
    """Sort every `nn.Linear` of `model` into converted / high precision by name / high precision by shape."""
    plan = Float8Plan()
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            _plan_experts(plan, name, module)
        if type(module) is not nn.Linear:  # a Float8Linear already converted is an nn.Linear subclass
            continue
        out_features, in_features = module.weight.shape
        if name.rsplit(".", 1)[-1] in HIGH_PRECISION:
            plan.by_name.append(name)
        elif out_features % ALIGNMENT or in_features % ALIGNMENT:
            plan.by_shape.append(f"{name} [{out_features}x{in_features}]")
        else:
            plan.converted.append(name)
    return plan


def _plan_experts(plan: Float8Plan, name: str, moe: MoE) -> None:
    n_experts, dim, hidden = moe.experts.w2.shape[0], moe.dim, moe.cfg.expert_hidden
    if moe.cfg.impl == "loop":
        plan.experts_by_impl.append(name)
    elif dim % ALIGNMENT or hidden % ALIGNMENT:
        plan.by_shape.append(f"{name}.experts [{n_experts}x{dim}x{hidden}]")
    else:
        plan.experts.append(name)


def convert_to_float8(model: nn.Module, recipe: str, *, float8_all_gather: bool = False,
                      device_type: str = "cpu") -> Float8Plan:
    """Swap the linears `plan_float8` converts for torchao `Float8Linear`s of `recipe`, in place; return the plan.

    `float8_all_gather`: the model will be FSDP-sharded, so tensorwise weights are gathered in float8.
    `device_type`: where the model will run; off CUDA the GEMMs run in torchao's emulation (`NATIVE_ON`).
    Runs on the meta device as well (before the weights exist).
    """
    config = float8_config(recipe, float8_all_gather, emulate=device_type not in NATIVE_ON)
    plan = plan_float8(model)
    chosen = set(plan.converted)
    _torchao_float8().convert_to_float8_training(model, config=config,
                                                 module_filter_fn=lambda _module, name: name in chosen)
    modules = dict(model.named_modules())
    if config.enable_fsdp_float8_all_gather:  # on each linear: whichever module saves it (a pipeline's whole part)
        for name in plan.converted:
            modules[name].register_state_dict_post_hook(_plain_float8_weight)
    for name in plan.experts:
        modules[name].expert_float8 = True
    gather = "float8 all-gather" if config.enable_fsdp_float8_all_gather else "weights gathered in param_dtype"
    kept = ", ".join(sorted({n.rsplit(".", 1)[-1] for n in plan.by_name})) or "no named linear"
    if plan.experts_by_impl:
        kept += f", the routed experts of {len(plan.experts_by_impl)} MoE layers (moe.impl = loop)"
    log.info("float8 %s%s: %d linears in float8 (%s), the routed experts of %d MoE layers in float8 grouped GEMMs "
             "(torchao's rowwise grouped recipe%s); high precision: %s", recipe,
             " (torchao's emulation)" if config.emulate else "", len(plan.converted), gather, len(plan.experts),
             "" if device_type in NATIVE_ON else ", the scaled grouped GEMM emulated", kept)
    if plan.by_shape:
        log.warning("float8: %d modules stay high precision, a dimension not a multiple of %d: %s",
                    len(plan.by_shape), ALIGNMENT, ", ".join(plan.by_shape))
    return plan


def _plain_float8_weight(_linear: nn.Module, state_dict: dict, prefix: str, _local_metadata: dict) -> None:
    """State-dict post hook of a converted linear: its float8-gathered weight as the plain float32 tensor it wraps
    (the same storage).

    Under float8 all-gather a sharded weight is a DTensor over torchao's `WeightWithDynamicFloat8CastTensor`, a
    wrapper without storage of its own, which the safetensors checkpoint writer cannot read. Its `_tensor` is the
    float32 master shard itself, so saving reads it and loading writes into it in place. The hook sits on the
    linear, not on the converted root: under pipeline parallelism each stage part is converted, and the rank's
    whole part (which shares the stages' modules) is what checkpoints save.
    """
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor  # the optional extra

    key = prefix + "weight"
    value = state_dict.get(key)
    local = value._local_tensor if isinstance(value, DTensor) else value
    if not isinstance(local, WeightWithDynamicFloat8CastTensor):
        return
    state_dict[key] = (DTensor.from_local(local._tensor, value.device_mesh, value.placements, run_check=False,
                                          shape=value.shape, stride=value.stride())
                       if isinstance(value, DTensor) else local._tensor)


def precompute_float8_scales(model: nn.Module) -> None:
    """After an optimizer step: every float8-gathered weight's scale from one all-reduce of the amaxes.

    Without it each weight's all-gather reduces its own amax (the same scale, one collective per weight).
    Nothing happens for a model without float8-gathered weights.
    """
    _torchao_float8().precompute_float8_dynamic_scale_for_fsdp(model)
