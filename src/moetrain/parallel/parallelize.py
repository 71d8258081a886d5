"""Turn a model built on the meta device into the model a run trains: the one place parallelism is applied.

`parallelize_model` applies, in this order, activation checkpointing, `torch.compile` per
block, and FSDP2/HSDP sharding over the mesh (`moetrain.parallel.shard.apply_fsdp`). Order
matters: checkpointing and compile act on the blocks that FSDP then wraps as its units. The
model definition itself stays free of distributed code; this module changes how the model runs,
never what it computes, and it does not materialise or initialise parameters.

Activation checkpointing (`train.activation_checkpointing`) is "full" (recompute a whole block
in backward, keeping only its input), "selective" (an op-level policy: the outputs of the
matmuls and attention kernels are kept, the cheap ops between them, norms, activations,
routing, gathers, are recomputed; `torch.utils.checkpoint.create_selective_checkpoint_contexts`)
or "none"; `train.activation_checkpointing_every` = N applies it to blocks 0, N, 2N, ... only.

Compile (`train.compile`) compiles each block's training forward with `fullgraph=True` and
static shapes: the MoE path has no graph break (host counts become unbacked sizes inside the
graph, the memory-efficient layer is one opaque operator; see model/grouped_mm.py and
model/moe_function.py) and the attention plan is pinned to one method whose inputs keep their
shapes from batch to batch ("dense" mask on CPU, "flex" on CUDA, for `model.attention = "auto"`),
so no step recompiles. Forwards without autograd (evaluation, the global-balance routing pass,
sampling, whose sequence grows every token) run the same blocks eagerly: they never trigger a
compile, so evaluation cannot recompile a training graph either.

Before all of these, when the job's mesh has a tensor-parallel dimension, `apply_tensor_parallel`
splits the attention, dense FFNs, shared experts, embedding and LM head over it with sequence
parallelism between them (`moetrain.parallel.tensor_parallel`); when it has an expert-parallel
dimension, `apply_ep` splits every MoE layer's experts over the EP group and routes their tokens by
all-to-all (`moetrain.parallel.expert_parallel`); FSDP then shards what TP and EP have split.
Context parallelism changes no module: each forward gets its slice of the rows and an attention plan
over the whole rows (`moetrain.parallel.context_parallel`); FSDP's mesh folds its ranks in.

A one-rank mesh without expert parallelism is not wrapped: FSDP over one rank shards
nothing yet gathered, copied and hooked every unit on every forward and backward (1.6-2x
the bare model's forward+backward on the Qwen3-MoE debug shape). The parameters stay
plain tensors with their global shapes, which is exactly what a sharded run's
checkpoint holds (DCP saves global shapes), so checkpoints move between one rank and
many both ways. Mixed precision on that model is `moetrain.parallel.precision`'s.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from moetrain.config.parallel import ParallelConfig
from moetrain.errors import ConfigError
from moetrain.model import moe_function  # registers torch.ops.moetrain.memory_efficient_experts
from moetrain.parallel.expert_parallel import apply_expert_parallel
from moetrain.parallel.float8 import convert_to_float8
from moetrain.parallel.mesh import JobMesh
from moetrain.parallel.shard import apply_fsdp
from moetrain.parallel.tensor_parallel import apply_tensor_parallel


def apply_ep(model: nn.Module, job: JobMesh | None, ep: int) -> None:
    """Split every MoE layer's experts over the job's EP group of `ep` ranks (no-op for ep = 1)."""
    experts = None if job is None else job.experts
    if (1 if experts is None else experts.degree) != ep:
        raise ConfigError(f"parallel.ep = {ep} does not match the mesh ({'no' if experts is None else experts.degree}"
                          " EP dimension): build it with moetrain.parallel.mesh.JobMesh from the same config")
    if experts is not None and experts.ep is not None:
        apply_expert_parallel(model, experts.ep)


# Ops whose outputs selective checkpointing keeps: the GEMMs and attention kernels, where the
# FLOPs are. Everything else a block does (norms, RoPE, activations, routing, gathers, scatters)
# is cheap elementwise or indexing work and is recomputed in backward. The memory-efficient MoE
# layer is one operator (its GEMMs write into preallocated rows, aten.mm.out, which a policy cannot
# replay), so the policy keeps that operator's outputs.
SAVED_OPS = frozenset({
    moe_function.EXPERTS_OP,
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten._grouped_mm.default,
    torch.ops.aten._scaled_mm.default,  # train.float8's matmuls
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
})

CHECKPOINTING_MODES = ("none", "full", "selective")


def checkpointing_mode(value: bool | str) -> str:
    """`train.activation_checkpointing` as one of CHECKPOINTING_MODES (a TOML bool: true = "full", false = "none")."""
    mode = {True: "full", False: "none"}.get(value, value) if isinstance(value, bool) else value
    if mode not in CHECKPOINTING_MODES:
        raise ConfigError(f"train.activation_checkpointing = {value!r} is invalid: valid are "
                          f"{', '.join(CHECKPOINTING_MODES)} (or true/false)")
    return mode


def _save_matmuls_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_checkpoint_context():
    """The (forward, recompute) context pair of the selective policy, fresh for each checkpointed forward."""
    return create_selective_checkpoint_contexts(_save_matmuls_policy)


def apply_activation_checkpointing(model: nn.Module, mode: bool | str = "full", every: int = 1) -> None:
    """Checkpoint blocks 0, every, 2·every, ... in `mode` ("full", "selective"; "none" does nothing).

    Uses the composable `checkpoint` (hooks, no wrapper module) so parameter names and
    checkpoints are unchanged. Recomputation reruns the MoE forward, which adds the
    block's expert loads to the aux-free load counter a second time: every expert's
    load doubles, so the sign-based bias update is unchanged.
    """
    mode = checkpointing_mode(mode)
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ConfigError(f"train.activation_checkpointing_every = {every!r} is invalid: must be an integer >= 1")
    if mode == "none":
        return
    context_fn = selective_checkpoint_context if mode == "selective" else None
    for index, block in enumerate(model.layers):
        if index % every == 0:
            checkpoint(block, context_fn=context_fn)


# The compiler backend of the blocks; tests swap in "aot_eager" (dynamo and AOT autograd tracing
# without inductor's C++ build) where they check tracing rather than generated kernels.
COMPILE_BACKEND = "inductor"


class CompiledBlockForward:
    """A block's forward: compiled (fullgraph, static shapes) when autograd records, eager otherwise.

    Installed as the block's instance `forward`, so module hooks (checkpointing, FSDP) still run
    around it and parameter names are unchanged. The eager branch serves the no-grad forwards
    (evaluation, routing-only passes, sampling at every length) without ever compiling for them.
    """

    def __init__(self, block: nn.Module):
        self.eager = block.forward
        self.compiled = torch.compile(self.eager, fullgraph=True, dynamic=False, backend=COMPILE_BACKEND)

    def __call__(self, *args, **kwargs):
        if torch.is_grad_enabled():
            return self.compiled(*args, **kwargs)
        return self.eager(*args, **kwargs)


def compiled_attention_method(method: str, device_type: str) -> str:
    """The attention method compiled blocks use: one whose plan has the same structure every batch."""
    if method in ("segments", "blocks"):
        raise ConfigError(f"model.attention = {method!r} is invalid with train.compile = True: its layout changes "
                          "shape with every batch's documents (a recompile per batch); use auto, dense or flex")
    if method == "auto":
        return "flex" if device_type == "cuda" else "dense"
    return method


def apply_compile(model: nn.Module, device_type: str = "cpu") -> None:
    """Compile every block's training forward (see CompiledBlockForward) and pin the attention method."""
    if any(getattr(block, "is_moe", False) and block.moe.cfg.token_rounding_tile > 1 for block in model.layers):
        raise ConfigError("model.moe.token_rounding_tile > 1 is invalid with train.compile = True: rounding "
                          "decides per expert on the host; use 1 or turn compile off")
    # counts.tolist() in the MoE path becomes unbacked symbolic sizes inside the graph, not a graph break.
    torch._dynamo.config.capture_scalar_outputs = True
    model.attention_method = compiled_attention_method(model.attention_method, device_type)
    for block in model.layers:
        block.forward = CompiledBlockForward(block)


def parallelize_model(model: nn.Module, job: JobMesh | None, parallel: ParallelConfig, *,
                      activation_checkpointing: bool | str = False, compile: bool = False,
                      activation_checkpointing_every: int = 1, device_type: str = "cpu",
                      float8: str = "none") -> nn.Module:
    """Apply float8, TP, EP, activation checkpointing, compile and FSDP (not on one rank) to `model` in place.

    `device_type` is where the model will run (it may still be on the meta device here). `float8`
    (train.float8) swaps linears for torchao's float8 ones first (moetrain.parallel.float8).
    """
    if float8 != "none":
        convert_to_float8(model, float8, float8_all_gather=not runs_unsharded(job), device_type=device_type)
    if job is not None and job.tensor is not None:
        apply_tensor_parallel(model, job.tensor)
    apply_ep(model, job, parallel.ep)
    mode = checkpointing_mode(activation_checkpointing)
    if compile and mode == "selective":
        raise ConfigError("train.activation_checkpointing = 'selective' is invalid with train.compile = True: the "
                          "op-level policy sees eager ops only; use full or none with compile")
    apply_activation_checkpointing(model, mode, activation_checkpointing_every)
    if compile:
        apply_compile(model, device_type)
    if runs_unsharded(job):
        return model
    return apply_fsdp(model, job, parallel)


def runs_unsharded(job: JobMesh | None) -> bool:
    """Whether `parallelize_model` leaves the model unwrapped: no mesh, or one rank (never expert-parallel)."""
    return job is None or job.world == 1
