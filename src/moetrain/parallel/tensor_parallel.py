"""Tensor parallelism with sequence parallelism: the per-module plan on DTensor's parallel styles.

`apply_tensor_parallel(model, tp_mesh)` splits the model over the "tp" ranks with
`torch.distributed.tensor.parallel.parallelize_module`, Megatron's layout as torchtitan writes it:

- the residual stream between blocks is sequence-sharded: every rank holds [B, S / tp, d] as a
  plain tensor; the RMSNorms run on that slice (`SequenceParallel`, their weights replicated
  and their gradients summed over the ranks by DTensor);
- attention gathers the normed sequence (`PrepareModuleInput`: Shard(1) -> Replicate), each rank
  projects its own heads (`ColwiseParallel` on wq, wk, wv, biases included), attends over them, and
  `wo` (`RowwiseParallel`) reduce-scatters the result back to the sequence slices. Per-head
  QK-norm runs on the local heads with its one weight replicated (`SequenceParallel` over the heads
  dimension); RoPE (partial too), windows and document masks are per head, so they need nothing;
- the dense SwiGLU FFN and the MoE's shared expert are colwise (w1, w3) / rowwise (w2), the shared
  expert on the MoE's flattened [T / tp, d] tokens (gathered on dim 0, any token order serves a
  per-token FFN), its sigmoid gate replicated;
- the router takes each rank's own tokens with its weight replicated (`SequenceParallel` on the
  token dimension: its gradient is summed over the ranks), and the routed experts are not split
  (no expert tensor parallelism: fine-grained experts make skinny GEMMs, and it would double the
  all-to-alls); they route the sequence slice, under EP through the rank's own EP group, and are
  FSDP-sharded over efsdp x cp x tp so their gradients sum over the TP ranks' tokens
  (`moetrain.parallel.mesh.ExpertMeshes`);
- the embedding is split over the vocabulary (`RowwiseParallel`, output reduce-scattered to the
  sequence slices) and the LM head over the vocabulary too (`ColwiseParallel` with Shard(-1)
  DTensor logits): the loss is computed under `loss_parallel`, so no rank ever holds the whole
  vocabulary's logits (`vocab_parallel_loss`).

The model code reads its head counts from its projections' widths, so it runs on a rank's heads
unchanged. This module decides layouts; it does not shard over data-parallel ranks (FSDP,
moetrain.parallel.shard, runs after it) nor compute losses.
"""

from __future__ import annotations

import copy
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from moetrain.model.lora import LoRALinear
from moetrain.model.mla import MultiHeadLatentAttention


def _vocab_embedding() -> RowwiseParallel:
    """The token embedding split over the vocabulary, its output reduce-scattered to the sequence slices."""
    return RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))


def _ffn_plan(tokens_dim: int, prefix: str = "") -> dict:
    """SwiGLU w1, w3 colwise and w2 rowwise, its input gathered along `tokens_dim` and its output scattered back."""
    return {
        prefix.rstrip("."): PrepareModuleInput(input_layouts=(Shard(tokens_dim),),
                                               desired_input_layouts=(Replicate(),), use_local_output=True),
        f"{prefix}w1": ColwiseParallel(),
        f"{prefix}w3": ColwiseParallel(),
        f"{prefix}w2": RowwiseParallel(output_layouts=Shard(tokens_dim)),
    }


def _attention_plan(attention: nn.Module) -> dict:
    """Heads split over the ranks: the projections to heads colwise, the output projection rowwise."""
    if isinstance(attention, MultiHeadLatentAttention):
        # The low-rank projections (wq_a, wkv_a) and their norms stay whole on every rank, as torchtitan and
        # Megatron keep them: computed on the gathered sequence, their gradients are already whole where the
        # colwise wq_b / wkv_b sum their inputs' gradients over the ranks; the shared RoPE key is the exception.
        heads = ["wq" if attention.q_lora_rank is None else "wq_b", "wkv_b"]
    else:
        heads = ["wq", "wk", "wv"]
    return {**{f"attention.{name}": ColwiseParallel() for name in heads},
            "attention.wo": RowwiseParallel(output_layouts=Shard(1))}


def _sum_grad_over_ranks(tensor: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """Identity forward; backward sums the gradient over the TP ranks (DTensor: Partial -> Replicate)."""
    return DTensor.from_local(tensor, tp_mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def _shared_rope_key_grad(attention: MultiHeadLatentAttention, tp_mesh: DeviceMesh) -> None:
    """MLA's one RoPE key part serves every head, so a rank's gradient of it covers its own heads only: a forward
    hook on wkv_a makes those columns' gradient the sum over the ranks (the latent's is summed by wkv_b)."""
    latent = attention.kv_lora_rank

    def hook(module, args, output):
        return torch.cat((output[..., :latent], _sum_grad_over_ranks(output[..., latent:], tp_mesh)), dim=-1)

    attention.wkv_a.register_forward_hook(hook)


def _block_plan(block: nn.Module) -> dict:
    plan: dict = {
        "attention_norm": SequenceParallel(use_local_output=False),
        "ffn_norm": SequenceParallel(use_local_output=False),
        # (x, positions, plan): x is gathered over the sequence, the rest passes as it is.
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                        desired_input_layouts=(Replicate(), None, None), use_local_output=True),
        **_attention_plan(block.attention),
    }
    if getattr(block.attention, "q_norm", None) is not None:  # per-head QK-norm: its weight serves local heads
        plan["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if not block.is_moe:
        plan.update(_ffn_plan(1, "feed_forward."))
        return plan
    # The MoE layer takes the rank's own tokens [B, S / tp, d] as a plain tensor.
    plan["moe"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),),
                                     use_local_output=True)
    plan["moe.router"] = SequenceParallel(sequence_dim=0, use_local_output=True)
    if block.moe.shared_expert is not None:
        plan.update(_ffn_plan(0, "moe.shared_expert."))
    if block.moe.shared_expert_gate is not None:
        plan["moe.shared_expert_gate"] = SequenceParallel(sequence_dim=0, use_local_output=True)
    return plan


class _LocalSinks:
    """Forward hooks that give attention its rank's sinks: the [H] parameter is a Shard(0) DTensor over the TP
    ranks, and for the forward the module holds its local [H / tp] view (its gradient flows back through
    `to_local`), so the model reads one sink per local head as it reads its local projections."""

    def before(self, module: nn.Module, args) -> None:
        sinks = module._parameters["sinks"]
        if isinstance(sinks, DTensor):  # not yet swapped (a recomputation reruns the hooks on the same module)
            module.__dict__["_tp_sinks"] = sinks  # not setattr: that would register a second parameter
            module._parameters["sinks"] = sinks.to_local()

    def after(self, module: nn.Module, args, output) -> None:
        module._parameters["sinks"] = module._tp_sinks


def _split_sinks(attention: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Attention sinks split over the TP ranks with the heads (Shard(0)), read locally in the forward."""
    attention.sinks = nn.Parameter(distribute_tensor(attention.sinks, tp_mesh, [Shard(0)]))
    hooks = _LocalSinks()
    attention.register_forward_pre_hook(hooks.before)
    attention.register_forward_hook(hooks.after)


# ---- LoRA: adapter-aware column- and row-wise styles -------------------------------------------------------

def _distribute_linear(module: nn.Module, mesh: DeviceMesh, placements: dict[str, Placement],
                       src_data_rank: int | None) -> None:
    """Each of the module's own parameters a DTensor over `mesh` with its placement in `placements`."""
    for name, param in list(module.named_parameters(recurse=False)):
        module.register_parameter(name, nn.Parameter(
            distribute_tensor(param, mesh, [placements[name]], src_data_rank=src_data_rank),
            requires_grad=param.requires_grad))


class AdapterColwiseParallel(ColwiseParallel):
    """ColwiseParallel for a `LoRALinear`: W, its bias and lora_B split on their output rows (Shard(0)), lora_A
    whole (Replicate). The gathered input x gives every rank the same A x [.., r], its B rows make its own
    output columns; A's gradient (Partial: each rank's columns contribute) is summed over the ranks by DTensor."""

    def _partition_linear_fn(self, name, module, device_mesh):
        _distribute_linear(module, device_mesh, {"weight": Shard(0), "bias": Shard(0), "lora_A": Replicate(),
                                                 "lora_B": Shard(0)}, self.src_data_rank)


class AdapterRowwiseParallel(RowwiseParallel):
    """RowwiseParallel for a `LoRALinear`: W and lora_A split on their input columns (Shard(1)), the bias and
    lora_B whole. Each rank's A x is a partial sum over its input slice, B of it is too (B is linear), so the
    layer's output stays one Partial sum that the output layout reduces; B's gradient is summed by DTensor."""

    def _partition_linear_fn(self, name, module, device_mesh):
        _distribute_linear(module, device_mesh, {"weight": Shard(1), "bias": Replicate(), "lora_A": Shard(1),
                                                 "lora_B": Replicate()}, self.src_data_rank)


_ADAPTER_STYLES = {ColwiseParallel: AdapterColwiseParallel, RowwiseParallel: AdapterRowwiseParallel}


def parallelize_keeping_frozen(module: nn.Module, tp_mesh: DeviceMesh, plan: dict) -> None:
    """`parallelize_module` with adapter-aware styles (`with_adapter_styles`) that leaves frozen parameters
    frozen: `SequenceParallel` re-registers every parameter it replicates as trainable (the norms, the router,
    QK-norm), which under LoRA would train (and keep optimizer state for) a base that must not move."""
    frozen = [name for name, param in module.named_parameters() if not param.requires_grad]
    parallelize_module(module, tp_mesh, with_adapter_styles(module, plan))
    for name in frozen:
        module.get_parameter(name).requires_grad_(False)


def with_adapter_styles(module: nn.Module, plan: dict) -> dict:
    """`plan` with each column- or row-wise style of an adapted linear (`LoRALinear` applied to activations)
    swapped for its adapter-aware twin, the same input and output layouts kept. A folded adapter (the router,
    replicated by `SequenceParallel`) and unadapted linears keep their style."""
    adapted = {}
    for name, style in plan.items():
        layer = module.get_submodule(name) if name else module
        twin = _ADAPTER_STYLES.get(type(style))
        if twin is not None and isinstance(layer, LoRALinear) and not layer.lora_folded:
            style = copy.copy(style)
            style.__class__ = twin
        adapted[name] = style
    return adapted


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Split `model` (a moetrain Transformer, on any device, meta included) over `tp_mesh` in place.

    A pipeline stage's part holds the embedding or the norm and head only at the pipeline's ends: the plan
    covers the modules it holds. Between stages the hidden states stay sequence-sharded ([B, S / tp, d] on
    each TP rank, what the blocks take and return), so a stage sends and receives only its rank's slice.
    """
    ends = {
        "tok_embeddings": _vocab_embedding(),
        "norm": SequenceParallel(use_local_output=False),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    held = {name: style for name, style in ends.items() if getattr(model, name, None) is not None}
    if held:
        parallelize_keeping_frozen(model, tp_mesh, held)
    for block in model.layers:
        _parallelize_block(block, tp_mesh)
    _parallelize_mtp(model, tp_mesh)


def _parallelize_block(block: nn.Module, tp_mesh: DeviceMesh) -> None:
    """One transformer block (a main one or a multi-token-prediction module's) split over `tp_mesh`."""
    parallelize_keeping_frozen(block, tp_mesh, _block_plan(block))
    if getattr(block.attention, "sinks", None) is not None:
        _split_sinks(block.attention, tp_mesh)
    if isinstance(block.attention, MultiHeadLatentAttention):
        _shared_rope_key_grad(block.attention, tp_mesh)


def _parallelize_mtp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """The multi-token-prediction modules (`model.mtp`) under TP, laid out like the main path around them.

    Each module takes its inputs sequence-sharded like a block (h^{k-1} and the embedded tokens ahead, the
    latter from the vocabulary-parallel embedding's reduce-scatter), and the [B, S] ids ahead whole: they
    are cut to the rank's slice (Replicate -> Shard(1), no communication) for the zero rows past the end.
    enorm, hnorm and eh_proj are per-token maps on the slice with replicated weights whose gradients DTensor
    sums over the ranks (`SequenceParallel`), the block gets a main block's plan, and the output norm hands
    the head a sequence-sharded DTensor as the final norm does. A pipeline's last stage embeds the tokens
    ahead with its copy of the embedding (`mtp_embeddings`), split over the vocabulary as the first stage's.
    """
    if getattr(model, "mtp_embeddings", None) is not None:
        parallelize_keeping_frozen(model, tp_mesh, {"mtp_embeddings": _vocab_embedding()})
    inputs = PrepareModuleInput(input_layouts=(Shard(1), Shard(1), Replicate(), None, None),
                                desired_input_layouts=(Shard(1), Shard(1), Shard(1), None, None),
                                use_local_output=True)
    for module in getattr(model, "mtp", ()):
        parallelize_module(module, tp_mesh, inputs)
        parallelize_keeping_frozen(module, tp_mesh, {"enorm": SequenceParallel(use_local_output=True),
                                             "hnorm": SequenceParallel(use_local_output=True),
                                             "eh_proj": SequenceParallel(use_local_output=True),
                                             "norm": SequenceParallel(use_local_output=False)})
        _parallelize_block(module.block, tp_mesh)


def vocab_parallel_loss(tensor_parallel: bool) -> AbstractContextManager:
    """The context a loss and its backward run in: `loss_parallel` under TP (cross-entropy on logits split over
    the vocabulary, each rank its own columns), else nothing."""
    return loss_parallel() if tensor_parallel else nullcontext()


def local_loss(loss: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor: `loss_parallel`'s result is a replicated DTensor (every TP rank the same value)."""
    return loss.to_local() if isinstance(loss, DTensor) else loss
