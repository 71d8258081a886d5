"""LoRA adapters on a `Transformer`: which matrices get them, how they compute, how they start and merge.

`apply_lora` freezes every base parameter and gives each targeted matrix W a pair (A, B) in float32:
the layer then computes W x + s · B A x with s = alpha / rank, A drawn as PEFT draws it (uniform in
±1/sqrt(fan_in), kaiming_uniform with a = sqrt(5)) and B zero, so training starts from the base model.

Two ways of applying an adapter, each PEFT's own for the same target, so an exported adapter computes
in transformers + peft what it computes here:

- Linear layers applied to activations (attention projections, MLA's low-rank ones included, the dense
  feed-forward, the shared expert): `LoRALinear` adds s · B(A(dropout(x))) to the base output, as
  PEFT's `lora.Linear` does.
- Weights used as a whole (the router, the routed experts' stacked w1 [E, d, N] and w2 [E, n, d]):
  the update is folded into the weight before it is used, W + s · Aᵀ Bᵀ per expert, one batched GEMM
  over all experts (`torch.baddbmm`), as PEFT's `ParamWrapper` does for `target_parameters`. Every
  expert implementation (loop, grouped GEMM, memory-efficient, expert-parallel) then runs on the
  adapted weights unchanged, and its weight gradient flows back into A and B through two more
  batched GEMMs: no Python loop over experts anywhere. No dropout can apply there.

Routed-expert adapters (`expert_mode`): "per_expert" stacks one (A, B) per expert, A [E, r, in] and
B [E, out, r] (PEFT's per-expert blocks of lora_A / lora_B); "shared" keeps one [1, r, in] / [1, out, r]
pair every expert of the layer adds.

Parameter names gain `lora_A` / `lora_B` next to the weight they adapt (`layers.0.attention.wq.lora_A`,
`layers.1.moe.experts.lora_A1`); the base names are unchanged, so Hugging Face import, initialisation
and checkpoints see the same model. This module holds no distributed code: adapters are parameters
like any other, which EP and FSDP shard from outside (the routed-expert ones with the experts).
"""

from __future__ import annotations

import hashlib
import math
from contextlib import AbstractContextManager, nullcontext
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moetrain.config.lora import LoraConfig
from moetrain.model.init import _local_view, is_adapter_name
from moetrain.model.moe import MoE, RoutedExpertWeights


class LoRALinear(nn.Linear):
    """An `nn.Linear` with an adapter: W x + b + s · B A x. Made by `adapt_linear` from a built layer."""

    lora_A: nn.Parameter  # [r, in]
    lora_B: nn.Parameter  # [out, r]
    lora_scaling: float
    lora_dropout: float
    lora_folded: bool  # True: W + s · B A is used as the weight (PEFT's parameter targeting)

    def delta_weight(self) -> Tensor:
        """s · B A [out, in], in the adapters' dtype."""
        return (self.lora_B @ self.lora_A) * self.lora_scaling

    def forward(self, x: Tensor) -> Tensor:
        if self.lora_folded:
            weight = (self.weight + self.delta_weight()).to(x.dtype)
            return F.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype))
        result = super().forward(x)
        adapter_in = F.dropout(x, self.lora_dropout, self.training) if self.lora_dropout else x
        update = F.linear(F.linear(adapter_in.to(self.lora_A.dtype), self.lora_A), self.lora_B) * self.lora_scaling
        return result + update.to(result.dtype)


def adapt_linear(linear: nn.Linear, rank: int, scaling: float, dropout: float = 0.0, folded: bool = False) -> None:
    """Turn `linear` into a `LoRALinear` in place (same object, same parameter names, plus lora_A / lora_B)."""
    device = linear.weight.device
    linear.__class__ = LoRALinear
    linear.lora_A = nn.Parameter(torch.zeros(rank, linear.in_features, device=device, dtype=torch.float32))
    linear.lora_B = nn.Parameter(torch.zeros(linear.out_features, rank, device=device, dtype=torch.float32))
    linear.lora_scaling, linear.lora_dropout, linear.lora_folded = scaling, dropout, folded


def _factors(lora_A: Tensor, lora_B: Tensor, n_experts: int) -> tuple[Tensor, Tensor]:
    """(Aᵀ, Bᵀ) as batched GEMM operands [E, in, r] and [E, r, out]; a shared pair is expanded, not copied."""
    lhs, rhs = lora_A.transpose(1, 2), lora_B.transpose(1, 2)
    if lhs.shape[0] != n_experts:  # one adapter shared by every expert
        lhs, rhs = lhs.expand(n_experts, -1, -1), rhs.expand(n_experts, -1, -1)
    return lhs, rhs


def fold(weight: Tensor, lora_A: Tensor, lora_B: Tensor, scaling: float) -> Tensor:
    """W + s · Aᵀ Bᵀ per expert: W [E, in, out], A [E or 1, r, in], B [E or 1, out, r]; in A's dtype or wider.

    A shared adapter (one pair for every expert) folds into this rank's experts only: under expert
    parallelism W is this rank's slice, A and B are whole on every rank, and the expert functions take
    the local stack either way."""
    if lora_A.shape[0] != weight.shape[0]:
        weight = _local(weight)
    lhs, rhs = _factors(lora_A, lora_B, weight.shape[0])
    base = weight.to(torch.promote_types(weight.dtype, lora_A.dtype))
    return torch.baddbmm(base, lhs, rhs, alpha=scaling)


class _FoldInto(torch.autograd.Function):
    """`fold` written into a preallocated stack (`out`), with the same backward as autograd's for `fold`.

    Every MoE layer folds stacks of the same shapes, one layer at a time; writing them into one reused
    stack per shape keeps a fresh 100 MB allocation (and its free) out of every layer's forward and
    backward, which on the host heap left holes that the adapters' gradients and AdamW's moments then
    split (measured on qwen3_moe_debug: +0.4-0.7 GB of heap over the live tensors)."""

    @staticmethod
    def forward(ctx, weight: Tensor, lora_A: Tensor, lora_B: Tensor, scaling: float, out: Tensor) -> Tensor:  # noqa: D102
        lhs, rhs = _factors(lora_A, lora_B, weight.shape[0])
        out.copy_(weight).baddbmm_(lhs, rhs, alpha=scaling)
        ctx.save_for_backward(lora_A, lora_B)
        ctx.scaling, ctx.n_experts = scaling, weight.shape[0]
        return out.detach()  # a new tensor over the stack: the stack itself is never part of a graph

    @staticmethod
    def backward(ctx, grad: Tensor):  # noqa: D102
        lora_A, lora_B = ctx.saved_tensors
        lhs, rhs = _factors(lora_A, lora_B, ctx.n_experts)
        # baddbmm's own derivative, then expand's (a sum over the experts sharing one pair)
        grad_lhs = grad.bmm(rhs.transpose(1, 2)).mul_(ctx.scaling)  # in place on the fresh product: same values
        grad_rhs = lhs.transpose(1, 2).bmm(grad).mul_(ctx.scaling)
        if lora_A.shape[0] != ctx.n_experts:
            grad_lhs, grad_rhs = grad_lhs.sum(0, keepdim=True), grad_rhs.sum(0, keepdim=True)
        return None, grad_lhs.transpose(1, 2), grad_rhs.transpose(1, 2), None, None


_STACKS: dict[tuple, Tensor] = {}
"""(projection, shape, dtype, device) -> the one stack every layer's fold of that projection writes into."""


def _stack_for(projection: str, weight: Tensor, lora_A: Tensor) -> Tensor:
    dtype = torch.promote_types(weight.dtype, lora_A.dtype)
    key = (projection, tuple(weight.shape), dtype, weight.device)
    if key not in _STACKS:
        _STACKS[key] = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    return _STACKS[key]


def _recipes_apply() -> bool:
    """Whether autograd may keep a recipe instead of a folded stack: not under compile, and no other
    saved-tensor hook decides (activation checkpointing saves no block tensor at all)."""
    return not torch.compiler.is_compiling() and torch._C._autograd._top_saved_tensors_default_hooks(False) is None


class LoRAExpertWeights(RoutedExpertWeights):
    """Stacked expert weights with adapters on w1 (lora_A1, lora_B1) and w2 (lora_A2, lora_B2)."""

    lora_scaling: float

    def delta_weights(self) -> tuple[Tensor, Tensor]:
        """(Δw1, Δw2) [E or 1, in, out]: s · Aᵀ Bᵀ of each adapter."""
        return tuple(torch.bmm(a.transpose(1, 2), b.transpose(1, 2)) * self.lora_scaling
                     for a, b in ((self.lora_A1, self.lora_B1), (self.lora_A2, self.lora_B2)))

    def weights(self) -> tuple[Tensor, Tensor]:
        """The folded stacks; written into the reused stacks where nothing but this layer's call reads them:
        autograd keeps recipes (`saving`) and the stacks are plain tensors (an expert-parallel fold is a
        DTensor, folded as it is)."""
        factors = ((self.w1, self.lora_A1, self.lora_B1), (self.w2, self.lora_A2, self.lora_B2))
        if _recipes_apply() and not any(hasattr(t, "to_local") for t in (self.w1, self.w2, self.lora_A1)):
            return tuple(_FoldInto.apply(w, a, b, self.lora_scaling, _stack_for(f"w{i}", w, a))
                         for i, (w, a, b) in enumerate(factors, 1))
        return tuple(fold(w, a, b, self.lora_scaling) for w, a, b in factors)

    def saving(self, w1: Tensor, w2: Tensor) -> AbstractContextManager:
        """Autograd keeps how to fold w1 and w2 again instead of the folded stacks (refolded in backward).

        The expert functions save the weights they get for backward; kept, every layer's folded stacks would
        live until its backward, another copy of all expert weights. Where another saved-tensor hook already
        decides (activation checkpointing saves no block tensor at all) or under compile, nothing changes."""
        if not _recipes_apply():
            return nullcontext()
        # Where each folded stack lives, never the stack itself: the hooks outlive the forward (every saved
        # tensor keeps them), and a reference here would keep the stacks alive just the same.
        recipes = [(_where(w1), ("w1", self.w1, self.lora_A1, self.lora_B1)),
                   (_where(w2), ("w2", self.w2, self.lora_A2, self.lora_B2))]

        def pack(saved: Tensor) -> Tensor | _Refold:
            for (storage, offset, dtype), (projection, weight, lora_A, lora_B) in recipes:  # the stack or a view
                if saved.dtype == dtype and saved.untyped_storage().data_ptr() == storage:
                    view = (tuple(saved.shape), saved.stride(), saved.storage_offset() - offset)
                    return _Refold(weight, lora_A, lora_B, self.lora_scaling, view, projection)
            return saved

        def unpack(saved: Tensor | _Refold) -> Tensor:
            if isinstance(saved, _Refold):
                with torch.no_grad():
                    refolded = _local(_refold(saved))
                shape, stride, offset = saved.view
                return refolded.as_strided(shape, stride, refolded.storage_offset() + offset)
            return saved

        return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


class _Refold(NamedTuple):
    """What `fold` needs to form a folded expert stack again, and which view of it was saved."""

    weight: Tensor
    lora_A: Tensor
    lora_B: Tensor
    scaling: float
    view: tuple[tuple[int, ...], tuple[int, ...], int]  # (shape, stride, offset from the stack's start)
    projection: str  # "w1" or "w2": which reused stack a plain fold goes back into


def _refold(saved: _Refold) -> Tensor:
    """The folded stack again (no autograd), into its reused stack when the fold is a plain tensor."""
    weight, lora_A, lora_B = saved.weight, saved.lora_A, saved.lora_B
    if any(hasattr(t, "to_local") for t in (weight, lora_A)):
        return fold(weight, lora_A, lora_B, saved.scaling)
    lhs, rhs = _factors(lora_A, lora_B, weight.shape[0])
    return _stack_for(saved.projection, weight, lora_A).copy_(weight).baddbmm_(lhs, rhs, alpha=saved.scaling)


def _where(folded: Tensor) -> tuple[int, int, torch.dtype]:
    """(storage address, storage offset, dtype) of this rank's part of a folded stack."""
    local = _local(folded)
    return local.untyped_storage().data_ptr(), local.storage_offset(), local.dtype


def _local(t: Tensor) -> Tensor:
    """This rank's part of an expert-parallel stack (what the expert functions see and save), else `t`."""
    return t.to_local() if hasattr(t, "to_local") else t


def adapt_experts(experts: RoutedExpertWeights, rank: int, scaling: float, shared: bool) -> None:
    """Turn `experts` into `LoRAExpertWeights` in place: one adapter per expert, or one shared (`shared`)."""
    device = experts.w1.device
    stacks = 1 if shared else experts.w1.shape[0]
    experts.__class__ = LoRAExpertWeights
    for suffix, weight in (("1", experts.w1), ("2", experts.w2)):
        fan_in, fan_out = weight.shape[1], weight.shape[2]
        setattr(experts, f"lora_A{suffix}",
                nn.Parameter(torch.zeros(stacks, rank, fan_in, device=device, dtype=torch.float32)))
        setattr(experts, f"lora_B{suffix}",
                nn.Parameter(torch.zeros(stacks, fan_out, rank, device=device, dtype=torch.float32)))
    experts.lora_scaling = scaling


def targeted_linears(model: nn.Module, target: str) -> list[nn.Linear]:
    """The linear layers of `target` ("attention", "ffn", "shared_experts", "router") in block order."""
    found: list[nn.Linear] = []
    for block in model.layers:
        moe: MoE | None = block.moe if block.is_moe else None
        if target == "router":
            found += [] if moe is None else [moe.router]
            continue
        owner = {"attention": block.attention, "ffn": None if moe is not None else block.feed_forward,
                 "shared_experts": None if moe is None else moe.shared_expert}[target]
        if owner is not None:
            found += [m for m in owner.children() if isinstance(m, nn.Linear)]
    return found


def apply_lora(model: nn.Module, lora: LoraConfig, frozen_dtype: torch.dtype | None = None) -> None:
    """Freeze `model` and add `lora`'s adapters (zeros until `init_adapters`); any device, meta included.

    `frozen_dtype` (the compute dtype) re-types the frozen floating-point parameters: they never take a
    gradient or an optimizer step, so no float32 master of them is kept.
    """
    for param in model.parameters():
        param.requires_grad_(False)
        if frozen_dtype is not None and param.is_floating_point() and param.dtype != frozen_dtype:
            param.data = param.data.to(frozen_dtype)
    for target in lora.targets:
        if target == "experts":
            for block in model.layers:
                if block.is_moe:
                    adapt_experts(block.moe.experts, lora.rank, lora.scaling, lora.expert_mode == "shared")
            continue
        folded = target == "router"
        for linear in targeted_linears(model, target):
            adapt_linear(linear, lora.rank, lora.scaling, 0.0 if folded else lora.dropout, folded)


def adapter_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Name -> parameter of every adapter of `model` (names as `named_parameters` gives them)."""
    return {name: param for name, param in model.named_parameters() if is_adapter_name(name)}


def _seed_of(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"lora|{seed}|{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int = 0) -> None:
    """A uniform in ±1/sqrt(fan_in) (PEFT's kaiming_uniform, a = sqrt(5)), B zero; the same values however
    the adapters are sharded (each rank fills its own slice of one draw per parameter)."""
    for name, param in adapter_parameters(model).items():
        local, shape, offset = _local_view(param)
        own = name.rpartition(".")[2]
        if own.startswith("lora_B") or local.numel() == 0:
            local.zero_()
            continue
        bound = 1.0 / math.sqrt(shape[-1])
        generator = torch.Generator().manual_seed(_seed_of(seed, name))
        full = torch.empty(shape, dtype=torch.float32).uniform_(-bound, bound, generator=generator)
        for dim, (start, length) in enumerate(zip(offset, local.shape, strict=True)):
            full = full.narrow(dim, start, length)
        local.copy_(full)


@torch.no_grad()
def merge_adapters(model: nn.Module) -> None:
    """Fold every adapter into its base weight in place (float32 arithmetic) and zero its B: the same model."""
    for module in model.modules():
        if isinstance(module, LoRALinear):
            module.weight.copy_(module.weight.float() + module.delta_weight())
            module.lora_B.zero_()
        elif isinstance(module, LoRAExpertWeights):
            for weight, delta in zip((module.w1, module.w2), module.delta_weights(), strict=True):
                weight.copy_(weight.float() + delta)
            module.lora_B1.zero_()
            module.lora_B2.zero_()
