"""FSDP2 sharding of a model: fully_shard units, mixed precision, SUM reductions, gradient guard.

`apply_fsdp` wraps each transformer block, then the embedding and the LM head, then
the root, with `fully_shard` on the job's FSDP mesh (`JobMesh.fsdp`: 1-D for FSDP, 2-D for HSDP
and for pure replication). It configures every unit to reduce gradients with plain
SUM collectives and no divide factor: the loss is already divided by the global
token count (see `moetrain.train.loss`), so FSDP's own averaging must be undone, and
PREMUL_SUM (which gloo cannot run and which has silently zeroed bf16 gradients on
some NCCL builds) must never be chosen. It also installs the gradient guard (every
reduced gradient exists and has the reduce dtype). This module changes how a model
is distributed; it must not change what the model computes.

Each unit prefetches the next units' all-gathers (`parallel.fsdp_prefetch`, `prefetch_ahead`) so they
travel while it computes.

Under expert parallelism the routed-expert weights (already DTensors over the EP group,
see `moetrain.parallel.expert_parallel`) stay in their block's unit but are sharded on
the expert-FSDP mesh: over the ranks that hold the same experts, replicated across
replica groups under HSDP.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.autograd.graph import register_multi_grad_hook
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

# Per-parameter meshes inside one unit (torchtitan's expert FSDP uses the same two names);
# torch 2.13 exports fully_shard's `shard_placement_fn` but not these result types.
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo, ShardPlacementResult
from torch.distributed.tensor import DTensor, Shard

from moetrain.config.parallel import ParallelConfig
from moetrain.dtypes import DTYPES
from moetrain.errors import ConfigError
from moetrain.parallel.expert_parallel import expert_parameters
from moetrain.parallel.gloo_comms import HostBufferPool, use_gloo_comms
from moetrain.parallel.mesh import EXPERT_DIM_NAMES, ExpertMeshes, JobMesh

_GUARD_MARK = "_moetrain_grad_dtype_guard"


def mixed_precision_policy(parallel: ParallelConfig) -> MixedPrecisionPolicy:
    """MixedPrecisionPolicy from config. Sharded (master) parameters keep their own dtype."""
    output = DTYPES[parallel.output_dtype] if parallel.output_dtype is not None else None
    return MixedPrecisionPolicy(param_dtype=DTYPES[parallel.param_dtype],
                                reduce_dtype=DTYPES[parallel.reduce_dtype], output_dtype=output)


def fsdp_modules(model: nn.Module) -> Iterator[FSDPModule]:
    """Every FSDP unit of a model (root included), in module order."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            yield module


def _tensors_in(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, tuple | list):
        return [t for item in value for t in _tensors_in(item)]
    return []


def _is_unsharded(param: torch.Tensor) -> bool:
    """Whether a registered parameter is FSDP's unsharded (gathered) form.

    Unsharded parameters are plain tensors, except expert- and tensor-parallel weights: those stay
    DTensors on the EP or TP mesh alone. FSDP's sharded parameters are DTensors whose mesh has a
    data-parallel dim.
    """
    return not isinstance(param, DTensor) or param.device_mesh.mesh_dim_names in (EXPERT_DIM_NAMES[-1:], ("tp",))


@dataclass
class _UnitParams:
    """The unsharded (gathered) parameters a unit owns, captured at its last forward."""

    params: list[torch.Tensor] = field(default_factory=list)
    fills_after_backward: bool = False  # the last forward's inputs carry the after-backward hook


@dataclass
class _GradientGuard:
    """Makes every gradient FSDP reduces exist and share one dtype: the reduce dtype.

    FSDP2 flattens a unit's gradients into one reduce-scatter buffer. It asserts one
    dtype, which breaks when a kernel hands back fp32 gradients for bf16 parameters
    (an unsharded parameter whose `grad_dtype` is None or float32), or when, under
    accumulation without sync, FSDP has already upcast earlier gradients to the reduce
    dtype and a parameter gets its first gradient on the last microbatch. And the
    buffer's layout depends on which parameters have a gradient, so a parameter
    without one on some microbatch or rank breaks the delayed all-reduce (FSDP adds
    flat buffers of different sizes) or mismatches ranks' reduce-scatters.

    Hooks fix both, without touching FSDP internals:
    - at the unit's forward, every owned parameter gets `grad_dtype = reduce_dtype`, so
      autograd casts what arrives;
    - once the unit's backward is done and before FSDP reduces it, every owned parameter
      still without a gradient gets a reduce-dtype zero gradient. "Done" is a grad hook on
      the unit's input, which fires just before FSDP's own post-backward (FSDP registers
      that on the same input, one autograd node further from the unit). A unit whose
      inputs need no gradient (the embedding takes token ids), or with several inputs that
      do, has no such single moment, so its parameters get their zero gradients before its
      backward (a grad hook on its outputs) and accumulate into them;
    - a post-accumulate-grad hook casts any gradient that still arrives in another
      dtype (a layer that resets its weight's grad_dtype during forward).
    FSDP copies gradients into a reduce-dtype buffer anyway, so no precision is lost.
    Filling after the backward costs nothing where every parameter got its gradient; the
    earlier version filled every parameter before the backward, and each MoE layer then
    spent a zero-filled copy of its expert gradients plus an add (qwen3_moe_debug on 4
    gloo ranks: 100 MiB fills, 1.5 s of a 26 s step, and one more layer of gradients
    alive at once). The unsharded parameters only exist once FSDP all-gathers (then
    they are reused), so a forward pre-hook, which runs after FSDP's own (prepended)
    pre-forward, finds them.
    """

    reduce_dtype: torch.dtype

    def cast_grad(self, param: torch.Tensor) -> None:
        if param.grad is not None and param.grad.dtype != self.reduce_dtype:
            # torch lets grad_dtype change only while there is no gradient; the new grad_dtype
            # also makes autograd cast later incoming gradients itself.
            grad, param.grad = param.grad, None
            param.grad_dtype = self.reduce_dtype
            param.grad = grad.to(self.reduce_dtype)

    def fill_missing_grads(self, unit: _UnitParams) -> None:
        for param in unit.params:
            param.grad_dtype = self.reduce_dtype
            if param.grad is None:
                # zeros_like keeps an expert-parallel weight's DTensor layout for its gradient. A weight gathered
                # in float8 (train.float8) is a torchao tensor without zeros_like; its gradient is a plain tensor.
                param.grad = (torch.zeros(param.shape, dtype=self.reduce_dtype, device=param.device)
                              if _gathered_in_float8(param) else torch.zeros_like(param, dtype=self.reduce_dtype))

    def before_forward(self, unit: _UnitParams, module: nn.Module, args: tuple) -> None:
        # Sharded parameters belong to other (not yet gathered) units.
        unit.params = [p for p in module.parameters() if p.requires_grad and _is_unsharded(p)]
        for param in unit.params:
            param.grad_dtype = self.reduce_dtype
            # The mark lives on the parameter itself (tensors cannot sit in weak sets:
            # their == is elementwise), so the hook is registered once per parameter.
            if getattr(param, _GUARD_MARK, None) is not self:
                param.register_post_accumulate_grad_hook(self.cast_grad)
                setattr(param, _GUARD_MARK, self)
        inputs = [t for t in _tensors_in(args) if t.requires_grad]
        unit.fills_after_backward = bool(torch.is_grad_enabled() and len(inputs) == 1 and unit.params)
        if unit.fills_after_backward:
            # Fires when the input's gradient is complete, i.e. after the unit's parameter
            # gradients were accumulated and before FSDP's post-backward consumes them. A plain
            # tensor hook: register_multi_grad_hook(mode="all") keeps the input's autograd node
            # referenced from its own hook, a cycle that leaked every step's graph (85 KiB/step
            # on the memory-flat job). Units with several such inputs keep the early fill.
            inputs[0].register_hook(lambda grad: self.fill_missing_grads(unit))

    def after_forward(self, unit: _UnitParams, module: nn.Module, args: tuple, output: Any) -> None:
        outputs = [t for t in _tensors_in(output) if t.requires_grad]
        if torch.is_grad_enabled() and outputs and unit.params and not unit.fills_after_backward:
            register_multi_grad_hook(outputs, lambda grads: self.fill_missing_grads(unit), mode="any")


def _gathered_in_float8(param: torch.Tensor) -> bool:
    # torchao's float8 all-gather output (Float8TrainingTensor), known by name: torchao is an optional extra.
    return type(param).__name__ == "Float8TrainingTensor" or type(param.data).__name__ == "Float8TrainingTensor"


def _shard_units(model: nn.Module) -> list[nn.Module]:
    units: list[nn.Module] = []
    layers = getattr(model, "layers", None)
    if layers is not None:
        units.extend(layers.values() if isinstance(layers, nn.ModuleDict) else layers)
    # Multi-token-prediction blocks (model.mtp) are blocks too: their own units, experts placed like the others'.
    units.extend(module.block for module in getattr(model, "mtp", ()))
    # Embedding and head as their own units so the largest matrices are gathered only
    # around their use. A tied head shares the embedding weight: it must live in one
    # unit, so it stays with the root.
    embedding = getattr(model, "tok_embeddings", None)
    head = getattr(model, "output", None)
    tied = embedding is not None and head is not None and getattr(head, "weight", None) is getattr(
        embedding, "weight", None)
    if embedding is not None and not tied:
        units.append(embedding)
    if head is not None and not tied:
        units.append(head)
    return units


def _expert_placement_fn(expert_params: set[nn.Parameter], experts: ExpertMeshes):
    """FSDP's `shard_placement_fn` under EP: expert weights on the expert-FSDP mesh, the rest as usual.

    Each EP rank's [E/ep, ...] block is sharded on dim 0 over the efsdp ranks when they divide
    E/ep evenly, else on dim 1 (torchtitan's choice: no padded, partly empty expert shards).
    """
    if experts.fsdp.ndim == 2:
        mesh_info: FSDPMeshInfo = HSDPMeshInfo(mesh=experts.fsdp, shard_mesh_dim=1, replicate_mesh_dim=0)
    else:
        mesh_info = FSDPMeshInfo(mesh=experts.fsdp, shard_mesh_dim=0)
    shard_size = mesh_info.shard_mesh_size

    def placement(param: nn.Parameter) -> ShardPlacementResult | None:
        if param not in expert_params:
            return None
        local_experts = param.shape[0] // experts.degree
        dim = 0 if local_experts % shard_size == 0 else 1
        if param.shape[dim] % shard_size:
            raise ConfigError(f"parallel.ep = {experts.degree} is invalid for expert weight {tuple(param.shape)}: "
                              f"neither its {local_experts} local experts nor its dim 1 divide evenly over "
                              f"{shard_size} expert-FSDP ranks (dp_shard / ep)")
        return ShardPlacementResult(placement=Shard(dim), mesh_info=mesh_info)

    return placement


def _sum_without_division(unit: FSDPModule) -> None:
    """Gradients reduce by plain SUM: a divide factor of 1, or none on a group of one rank.

    On a group whose data-parallel size is 1 (expert weights when `ep` equals `dp_shard`), FSDP2
    skips the reduce-scatter and copies the gradients with `input / factor` whenever a factor is
    set: a fresh gradient-sized tensor and one more pass over it per microbatch, to divide by 1.
    With no factor it copies them as they are. Every other group keeps the factor of 1, which is
    what makes FSDP2 sum instead of average.
    """
    for group in unit._get_fsdp_state()._fsdp_param_groups:
        group.gradient_divide_factor = None if group.mesh_info.mesh.size() == 1 else 1.0


def _forward_chain(model: nn.Module) -> list[FSDPModule]:
    """The units a plain forward runs, in its order: the embedding, the blocks, the head (those that are units).

    Multi-token-prediction blocks are left out: they run only in some forwards, after the head."""
    layers = getattr(model, "layers", None)
    blocks = list(layers.values() if isinstance(layers, nn.ModuleDict) else layers or [])
    chain = [getattr(model, "tok_embeddings", None), *blocks, getattr(model, "output", None)]
    return [unit for unit in chain if isinstance(unit, FSDPModule)]


def prefetch_ahead(model: FSDPModule, depth: int) -> None:
    """Each unit (the root first) issues the all-gathers of the next `depth` units in forward order once its own
    parameters are gathered, and FSDP's backward prefetch of the previous unit, without waiting for them.

    On a GPU FSDP2 overlaps by streams and this only issues the gathers earlier. On CPU (gloo) there is no
    stream: a gather FSDP issues synchronously (its default) runs while the rank waits, so the gathers are
    made asynchronous (`_set_unshard_async_op`, the switch FSDP2 leaves private in torch 2.13) and each unit
    waits for its own at its pre-forward / pre-backward (FSDP's all-gather copy-out). Values are unchanged:
    the same bytes are gathered, only earlier. A forward that stops early (the global-balance counting
    pre-pass) leaves a prefetched gather pending; the step's next forward uses it (no optimizer step lies
    between them).
    """
    chain = _forward_chain(model)
    if depth == 0 or not chain:
        return
    model._set_unshard_async_op(True)
    model.set_modules_to_forward_prefetch(chain[:depth])
    for index, unit in enumerate(chain):
        unit.set_modules_to_forward_prefetch(chain[index + 1:index + 1 + depth])


def apply_fsdp(
    model: nn.Module,
    job: JobMesh | None,
    parallel: ParallelConfig,
    *,
    gradient_guard: bool = True,
) -> nn.Module:
    """Shard `model` in place with FSDP2 on the job's FSDP mesh (experts on its expert-FSDP mesh) and return it.

    No mesh (None, or a one-rank world without a process group) leaves the model unsharded, which is only
    allowed in full float32. `gradient_guard=False` exists so tests can reproduce
    the crashes the guard prevents (see `_GradientGuard`); training never turns it off.
    """
    if job is None or job.fsdp is None:
        if (parallel.param_dtype, parallel.reduce_dtype) != ("float32", "float32"):
            raise ConfigError(f"parallel.param_dtype = {parallel.param_dtype!r} / parallel.reduce_dtype = "
                              f"{parallel.reduce_dtype!r} need a process group: call init_distributed first")
        return model
    policy = mixed_precision_policy(parallel)
    experts = job.experts
    placement = None if experts is None else _expert_placement_fn(expert_parameters(model), experts)
    for unit in _shard_units(model):
        fully_shard(unit, mesh=job.fsdp, mp_policy=policy, reshard_after_forward=parallel.reshard_after_forward,
                    shard_placement_fn=placement)
    # The root's parameters (final norm, tied weights) are needed as soon as backward
    # starts, so FSDP's default for the root (keep them gathered) is kept.
    fully_shard(model, mesh=job.fsdp, mp_policy=policy)
    prefetch_ahead(model, parallel.fsdp_prefetch)
    guard = _GradientGuard(DTYPES[parallel.reduce_dtype])
    pool = HostBufferPool()  # one per model: its units' gathers and reductions share buffers
    for unit in fsdp_modules(model):
        # Plain SUM over ranks with no division: the loss carries 1 / N_global.
        unit.set_force_sum_reduction_for_comms(True)
        _sum_without_division(unit)
        # On gloo, broadcasts and send/recv move the same bytes 3-4x cheaper (see gloo_comms).
        use_gloo_comms(unit, pool)
        if gradient_guard:
            owned = _UnitParams()
            unit.register_forward_pre_hook(functools.partial(guard.before_forward, owned))
            unit.register_forward_hook(functools.partial(guard.after_forward, owned))
    return model
