"""Routed-expert computation for MoE layers: routing records, grouped GEMMs, three implementations.

The MoE module (moe.py) decides *which* tokens go to which experts; this module computes
``out[t] = sum over assignments a of token t: scores[a] * (phi(x_t W1_e) W2_e)`` for a given
`Routing`. Three implementations share one contract (`routed_experts`):

- ``loop``: a plain per-expert Python loop with standard autograd; the reference.
- ``grouped``: one grouped GEMM per projection, standard autograd (it saves the gathered
  input and the expert outputs, O(tokens * top_k * hidden) bytes, for backward).
- ``memory_efficient``: the SonicMoE-style autograd Function in `moe_function.py`, which saves
  only X, the pre-activation H, scores and indices.

The grouped GEMM backend is chosen per device (`grouped_mm_backend`): ``torch._grouped_mm`` on
CUDA, and on CPU whichever of ``_grouped_mm`` and a loop of matmuls over contiguous expert
segments `moetrain bench moe` measured faster (see docs/bench_moe.md).

Token rounding (`round_routing`) rounds each expert's token count to a multiple of a GEMM tile.
This module has no distributed code and no parameters of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from moetrain.config import ConfigError

Backend = Literal["torch_grouped_mm", "segment_loop"]

ACTIVATIONS: tuple[str, ...] = ("swiglu", "gelu")
IMPLS: tuple[str, ...] = ("loop", "grouped", "memory_efficient")
BACKENDS: tuple[str, ...] = ("torch_grouped_mm", "segment_loop")

# CPU backend per implementation, chosen by measurement: `moetrain bench moe` times both backends
# side by side for the grouped and memory-efficient paths (numbers and commands in docs/bench_moe.md).
CPU_GROUPED_MM_BACKEND: dict[str, Backend] = {"grouped": "torch_grouped_mm", "memory_efficient": "segment_loop"}


@dataclass
class Routing:
    """Which token each routed assignment belongs to, grouped by expert (expert 0's first).

    token_index: LongTensor[N], token of each assignment; scores: Tensor[N], its gate weight
    (differentiable: the router gradient flows through it); counts: LongTensor[E], assignments per
    expert (sums to N), so expert e owns rows counts[:e].sum() ... counts[:e+1].sum() of N.
    """

    token_index: Tensor
    scores: Tensor
    counts: Tensor

    @property
    def n_experts(self) -> int:
        return int(self.counts.numel())

    @property
    def n_assignments(self) -> int:
        return int(self.token_index.numel())


def routing_from_topk(topk_idx: Tensor, topk_scores: Tensor, n_experts: int) -> Routing:
    """Group the (token, expert) choices of a top-k router by expert; within an expert, by token."""
    if topk_idx.dim() != 2 or topk_idx.shape != topk_scores.shape:
        raise ValueError(f"topk_idx {tuple(topk_idx.shape)} and topk_scores {tuple(topk_scores.shape)} "
                         "must both be [tokens, top_k]")
    # The friendly range check reads values on the host; on an accelerator that would stall the
    # stream every layer, so there an out-of-range index fails in the counting kernel instead.
    if topk_idx.device.type == "cpu" and topk_idx.numel() and (int(topk_idx.min()) < 0
                                                                or int(topk_idx.max()) >= n_experts):
        raise ValueError(f"expert indices must lie in [0, {n_experts}); got range "
                         f"[{int(topk_idx.min())}, {int(topk_idx.max())}]")
    top_k = topk_idx.shape[1]
    flat_expert = topk_idx.reshape(-1)
    # Stable sort keeps assignments of one expert in token order (flat index = token * k + slot).
    order = torch.argsort(flat_expert, stable=True)
    # index_add_ into a fixed-size count vector (unlike bincount, no host sync to size the output).
    counts = torch.zeros(n_experts, dtype=torch.long, device=topk_idx.device)
    counts.index_add_(0, flat_expert, torch.ones_like(flat_expert))
    return Routing(
        token_index=torch.div(order, top_k, rounding_mode="floor"),
        scores=topk_scores.reshape(-1)[order],
        counts=counts,
    )


# ---------------------------------------------------------------------------------------------
# Activations and their derivative (shared with the memory-efficient backward)
# ---------------------------------------------------------------------------------------------

def check_activation(activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ConfigError(f"moe activation = {activation!r} is invalid: valid activations are {', '.join(ACTIVATIONS)}")


def activation_forward(h: Tensor, activation: str) -> Tensor:
    """A = phi(H). SwiGLU: H = [gate | up] (width 2n), A = silu(gate) * up. GELU: A = gelu(H)."""
    if activation == "swiglu":
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(h)


def activation_backward(h: Tensor, grad_a: Tensor, activation: str) -> Tensor:
    """dH = dA * phi'(H), computed in float32 for low-precision inputs and returned in H's dtype."""
    compute_dtype = torch.float32 if h.dtype in (torch.bfloat16, torch.float16) else h.dtype
    h_c, grad_c = h.to(compute_dtype), grad_a.to(compute_dtype)
    if activation == "swiglu":
        gate, up = h_c.chunk(2, dim=-1)
        grad_h = torch.empty_like(h_c)
        # dH = [dA * up * silu'(gate) | dA * silu(gate)], written into the two halves without a cat.
        torch.ops.aten.silu_backward.grad_input(grad_c * up, gate, grad_input=grad_h[:, : gate.shape[1]])
        torch.mul(grad_c, F.silu(gate), out=grad_h[:, gate.shape[1] :])
        return grad_h.to(h.dtype)
    # Exact (erf) GELU, matching F.gelu's default.
    return torch.ops.aten.gelu_backward(grad_c, h_c).to(h.dtype)


def check_expert_shapes(x: Tensor, routing: Routing, w1: Tensor, w2: Tensor, activation: str) -> None:
    check_activation(activation)
    if x.dim() != 2 or w1.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"expected x [T,d], w1 [E,d,h], w2 [E,n,d]; got {tuple(x.shape)}, {tuple(w1.shape)}, "
                         f"{tuple(w2.shape)}")
    n_experts, dim, width = w1.shape
    inner = width // 2 if activation == "swiglu" else width
    if w2.shape != (n_experts, inner, dim) or x.shape[1] != dim or (activation == "swiglu" and width % 2):
        raise ValueError(f"inconsistent expert shapes for {activation}: x {tuple(x.shape)}, w1 {tuple(w1.shape)}, "
                         f"w2 {tuple(w2.shape)} (want w1 [E,d,{'2n' if activation == 'swiglu' else 'n'}], w2 [E,n,d])")
    if routing.n_experts != n_experts:
        raise ValueError(f"routing has {routing.n_experts} experts, weights have {n_experts}")
    if routing.token_index.shape != routing.scores.shape or routing.token_index.dim() != 1:
        raise ValueError("routing.token_index and routing.scores must both be 1-D of the same length")


# ---------------------------------------------------------------------------------------------
# Grouped GEMMs over contiguous expert segments
# ---------------------------------------------------------------------------------------------

def grouped_mm_backend(device: torch.device, dtype: torch.dtype, impl: str = "memory_efficient") -> Backend:
    """The grouped GEMM backend for a device: `_grouped_mm` on CUDA, the measured winner on CPU.

    float64 is not supported by `_grouped_mm` on any device, so it always takes the segment loop.
    On CUDA, `_grouped_mm` runs a CUTLASS grouped kernel for bf16 on sm90/sm100 and a per-group
    fallback otherwise; it needs 16-byte aligned strides (checked per call, else segment loop).
    """
    if dtype == torch.float64:
        return "segment_loop"
    if device.type == "cuda":
        return "torch_grouped_mm"
    return CPU_GROUPED_MM_BACKEND.get(impl, "segment_loop")


def _grouped_mm_usable(*mats: Tensor) -> bool:
    """`_grouped_mm` needs one dtype in {fp32, bf16, fp16} and 16-byte aligned strides and pointers."""
    dtype = mats[0].dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    for mat in mats:
        if mat.dtype != dtype or mat.data_ptr() % 16:
            return False
        # Every non-unit stride (in bytes) must be a multiple of 16.
        if any(s != 1 and (s * mat.element_size()) % 16 for s in mat.stride()):
            return False
    return True


def _offsets(counts: Tensor) -> Tensor:
    # `_grouped_mm` takes int32 cumulative end offsets, one per group, on the operands' device.
    return torch.cumsum(counts, 0, dtype=torch.int32)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous.

    torch 2.13's CPU `_grouped_mm` backward rejects a stride-0 gradient (what `out.sum()`
    produces): "Invalid strides/sizes, got [0, 0]". Placing this right after each `_grouped_mm`
    hands it a dense gradient instead. It saves nothing for backward.
    """

    @staticmethod
    def forward(ctx, tensor: Tensor) -> Tensor:  # noqa: D102
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # noqa: D102
        return grad.contiguous()


def grouped_mm(a: Tensor, b: Tensor, counts: Tensor, backend: Backend, counts_host: list[int] | None = None,
               out: Tensor | None = None) -> Tensor:
    """Rows of `a` [N,k] grouped by `counts` [E], each group times its `b[e]` [k,m] -> [N,m].

    Differentiable under standard autograd for both backends (used by the `grouped` impl), and
    immune to the stride-0 gradient bug of `_grouped_mm`. `out` (only without autograd) receives
    the result in place.
    """
    if backend == "torch_grouped_mm" and _grouped_mm_usable(a, b):
        result = _ContiguousGrad.apply(torch._grouped_mm(a, b, offs=_offsets(counts)))
        return result if out is None else out.copy_(result)
    sizes = counts.tolist() if counts_host is None else counts_host
    if not (torch.is_grad_enabled() and (a.requires_grad or b.requires_grad)):
        # No autograd (e.g. inside the memory-efficient Function): write each segment's product
        # straight into its rows of one output instead of concatenating pieces (saves an N x m copy).
        out = a.new_empty(a.shape[0], b.shape[2]) if out is None else out
        for seg, b_e, out_seg in zip(a.split(sizes, dim=0), b.unbind(0), out.split(sizes, dim=0), strict=True):
            if seg.shape[0]:
                torch.mm(seg, b_e, out=out_seg)
        return out
    # unbind, not b[e]: each select's backward would materialise a zero [E,k,m] gradient per expert.
    # Empty segments are multiplied too (a free [0,k] @ [k,m]) so the output stays connected to
    # every weight even when no token is routed at all: gradients are zeros, never None, which
    # keeps FSDP's per-parameter gradient reduction uniform across ranks.
    return torch.cat([seg @ b_e for seg, b_e in zip(a.split(sizes, dim=0), b.unbind(0), strict=True)], dim=0)


def grouped_mm_weight_grad(a: Tensor, g: Tensor, counts: Tensor, backend: Backend,
                           counts_host: list[int] | None = None, out: Tensor | None = None) -> Tensor:
    """Per-expert a_e^T g_e for rows grouped by `counts`: a [N,k], g [N,m] -> [E,k,m] (zeros for empty experts).

    Used only inside the memory-efficient backward (no autograd through it); `out` [E,k,m], if
    given, receives the result in place.
    """
    n_experts = counts.numel()
    if backend == "torch_grouped_mm" and _grouped_mm_usable(a, g):
        a_t = a.t()  # [k, N] view with unit row stride: the 2d x 2d form groups along the shared N dim
        if _grouped_mm_usable(a_t, g) and a.shape[0] > 0:
            result = torch._grouped_mm(a_t, g, offs=_offsets(counts))
            # Groups with no rows are left untouched by some kernels; zero them explicitly.
            result = result.masked_fill((counts == 0).view(-1, 1, 1), 0)
            return result if out is None else out.copy_(result)
    sizes = counts.tolist() if counts_host is None else counts_host
    out = torch.empty(n_experts, a.shape[1], g.shape[1], dtype=a.dtype, device=a.device) if out is None else out
    for a_seg, g_seg, out_e in zip(a.split(sizes, dim=0), g.split(sizes, dim=0), out.unbind(0), strict=True):
        if a_seg.shape[0] == 0:
            out_e.zero_()
        elif out_e.dtype == a.dtype:
            torch.mm(a_seg.t(), g_seg, out=out_e)
        else:
            out_e.copy_(a_seg.t() @ g_seg)
    return out


# ---------------------------------------------------------------------------------------------
# Implementations
# ---------------------------------------------------------------------------------------------

def _scatter_to_tokens(contrib: Tensor, token_index: Tensor, n_tokens: int) -> Tensor:
    """out[t] = sum of contrib rows whose token is t; summed in float32 for low-precision inputs."""
    acc_dtype = torch.float32 if contrib.dtype in (torch.bfloat16, torch.float16) else contrib.dtype
    out = torch.zeros(n_tokens, contrib.shape[1], dtype=acc_dtype, device=contrib.device)
    # index_put(accumulate=True) saves only the indices for backward; index_add would also save
    # the N x d source, inflating the standard-autograd baseline. It was also the faster on CPU.
    out = out.index_put((token_index,), contrib.to(acc_dtype), accumulate=True)
    return out.to(contrib.dtype)


def _experts_loop(x: Tensor, routing: Routing, w1: Tensor, w2: Tensor, activation: str) -> Tensor:
    """Reference: one expert at a time, plain matmuls, standard autograd."""
    sizes = routing.counts.tolist()
    pieces = []
    # Empty experts run too (zero-row matmuls) so every weight gets a zero gradient, never None.
    for tokens, scores, w1_e, w2_e in zip(routing.token_index.split(sizes), routing.scores.split(sizes),
                                          w1.unbind(0), w2.unbind(0), strict=True):
        expert_out = activation_forward(x[tokens] @ w1_e, activation) @ w2_e
        pieces.append(expert_out * scores.unsqueeze(1).to(expert_out.dtype))
    return _scatter_to_tokens(torch.cat(pieces), routing.token_index, x.shape[0])


def _experts_grouped(x: Tensor, routing: Routing, w1: Tensor, w2: Tensor, activation: str,
                     backend: Backend) -> Tensor:
    """Gather, two grouped GEMMs, weight by score, scatter back; standard autograd saves the lot."""
    sizes = routing.counts.tolist() if backend == "segment_loop" else None
    gathered = x.index_select(0, routing.token_index)
    hidden = grouped_mm(gathered, w1, routing.counts, backend, sizes)
    expert_out = grouped_mm(activation_forward(hidden, activation), w2, routing.counts, backend, sizes)
    weighted = expert_out * routing.scores.unsqueeze(1).to(expert_out.dtype)
    return _scatter_to_tokens(weighted, routing.token_index, x.shape[0])


def routed_experts(x: Tensor, routing: Routing, w1: Tensor, w2: Tensor, activation: str = "swiglu",
                   impl: str = "memory_efficient", backend: Backend | None = None) -> Tensor:
    """out[t] = sum over assignments a of token t: scores[a] * (phi(x_t W1_e) W2_e), shape [T,d].

    x [T,d]; w1 [E,d,2n] (swiglu) or [E,d,n] (gelu); w2 [E,n,d]. `backend` overrides the
    per-device grouped GEMM choice (the benchmark measures both).
    """
    if impl not in IMPLS:
        raise ConfigError(f"moe impl = {impl!r} is invalid: valid impls are {', '.join(IMPLS)}")
    if backend is not None and backend not in BACKENDS:
        raise ConfigError(f"grouped GEMM backend = {backend!r} is invalid: valid backends are {', '.join(BACKENDS)}")
    check_expert_shapes(x, routing, w1, w2, activation)
    # Weights kept in a wider dtype than the activations (e.g. fp32 master weights, bf16 compute) are
    # cast differentiably here, so every implementation sees one dtype.
    w1, w2 = w1.to(x.dtype), w2.to(x.dtype)
    chosen = grouped_mm_backend(x.device, x.dtype, impl) if backend is None else backend
    if impl == "loop":
        return _experts_loop(x, routing, w1, w2, activation)
    if impl == "grouped":
        return _experts_grouped(x, routing, w1, w2, activation, chosen)
    from moetrain.model.moe_function import memory_efficient_experts

    return memory_efficient_experts(x, routing, w1, w2, activation, chosen)


# ---------------------------------------------------------------------------------------------
# Token rounding
# ---------------------------------------------------------------------------------------------

def round_routing(router_probs: Tensor, routing: Routing, tile: int) -> tuple[Routing, int]:
    """Round every expert's assignment count to a multiple of `tile`; return (routing, decisions changed).

    For an expert with count c and remainder r = c mod tile, either drop its r lowest-score
    assignments or fill it with the (tile - r) highest-probability tokens not already routed to it,
    whichever changes fewer decisions (ties drop: less compute; fill only when enough tokens exist).
    Filled assignments take router_probs[t, e] as their gate weight, so they stay differentiable.
    """
    if not isinstance(tile, int) or tile < 1:
        raise ConfigError(f"token_rounding_tile = {tile!r} is invalid: must be an integer >= 1")
    n_tokens, n_experts = router_probs.shape
    if n_experts != routing.n_experts:
        raise ValueError(f"router_probs has {n_experts} experts, routing has {routing.n_experts}")
    if tile == 1:
        return routing, 0
    sizes = routing.counts.tolist()
    probs_detached = router_probs.detach()
    tokens_out, scores_out, counts_out = [], [], []
    changed = 0
    for e, (tokens, scores) in enumerate(zip(routing.token_index.split(sizes), routing.scores.split(sizes),
                                             strict=True)):
        count = sizes[e]
        remainder = count % tile
        fill = tile - remainder
        if remainder == 0:
            tokens_out.append(tokens)
            scores_out.append(scores)
        elif remainder <= fill or count + fill > n_tokens:
            # Drop the `remainder` lowest-score assignments; keep the rest in token order.
            keep = torch.topk(scores.detach(), count - remainder).indices.sort().values
            tokens_out.append(tokens[keep])
            scores_out.append(scores[keep])
            changed += remainder
        else:
            candidate = probs_detached[:, e].clone()
            candidate[tokens] = float("-inf")
            new_tokens = torch.topk(candidate, fill).indices
            merged = torch.cat([tokens, new_tokens])
            merged_scores = torch.cat([scores, router_probs[new_tokens, e].to(scores.dtype)])
            order = torch.argsort(merged, stable=True)
            tokens_out.append(merged[order])
            scores_out.append(merged_scores[order])
            changed += fill
        counts_out.append(tokens_out[-1].numel())
    rounded = Routing(
        token_index=torch.cat(tokens_out) if tokens_out else routing.token_index,
        scores=torch.cat(scores_out) if scores_out else routing.scores,
        counts=torch.tensor(counts_out, dtype=routing.counts.dtype, device=routing.counts.device),
    )
    return rounded, changed
