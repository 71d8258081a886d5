"""Routed-expert computation for MoE layers: three implementations behind one entry point.

The MoE layer (moe.py) decides *which* tokens go to which experts (routing.py); this module computes
``out[t] = sum over assignments a of token t: scores[a] * (phi(x_t W1_e) W2_e)`` for a given
`Routing`. Three implementations share one contract (`routed_experts`):

- ``loop``: a plain per-expert Python loop with standard autograd; the reference.
- ``grouped``: one grouped GEMM per projection, standard autograd (it saves the gathered
  input and the expert outputs, O(tokens * top_k * hidden) bytes, for backward).
- ``memory_efficient``: the SonicMoE-style autograd Function in `moe_function.py`, which saves
  only X, the pre-activation H, scores and indices.

Whatever the impl, inference on CPU with few assignments (generation's decode steps, `FEW_ASSIGNMENTS`)
runs each token's chosen experts one at a time straight from the top-k choice (`few_token_experts`).

Optional expert biases (GPT-OSS): b1 [E, width of W1] is added to x_t W1_e and b2 [E, d] to the
expert's output, before the score weighting: out[t] = sum scores[a] * (phi(x_t W1_e + b1_e) W2_e + b2_e).

Under `float8` (train.float8, set by moetrain.parallel.float8) the grouped and memory-efficient impls run
their GEMMs in torchao's rowwise float8 grouped recipe (float8_grouped_mm.py), forward and backward; the
loop stays the high-precision reference.

The grouped GEMMs, their per-device backend choice and the activations live in grouped_mm.py.
This module makes no routing decisions, holds no parameters of its own and has no distributed code.

Shape suffixes on local names: T tokens, D model dim, E experts, A routed assignments (grouped by
expert), N width of W1's output (2n for SwiGLU's fused gate | up, n for GELU), F the expert hidden
width n (W2's input); e.g. ``w1_EDN`` is [E, D, N].
"""

from __future__ import annotations

import torch
from torch import Tensor

from moetrain.errors import ModelError
from moetrain.model.float8_grouped_mm import Float8GroupedMM
from moetrain.model.grouped_mm import (
    BACKENDS,
    Activation,
    Backend,
    activation_forward,
    check_activation,
    grouped_mm,
    grouped_mm_backend,
    host_counts,
    is_gated,
)
from moetrain.model.moe_function import expert_of_rows, memory_efficient_experts
from moetrain.model.routing import Routing

IMPLS: tuple[str, ...] = ("loop", "grouped", "memory_efficient")

# Inference on CPU with at most this many routed assignments (generation's one-token decode steps:
# batch x top_k) skips the grouped layout (`few_token_experts`, chosen by the MoE layer): sorting the
# choice by expert and setting up the grouped GEMMs over all E experts (a split and an unbind of every
# expert, the custom op's dispatch) costs several times the few GEMV-sized products.
FEW_ASSIGNMENTS = 16


def check_expert_shapes(x: Tensor, routing: Routing, w1: Tensor, w2: Tensor, activation: Activation,
                        b1: Tensor | None = None, b2: Tensor | None = None) -> None:
    check_activation(activation)
    if x.dim() != 2 or w1.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"expected x [T,d], w1 [E,d,h], w2 [E,n,d]; got {tuple(x.shape)}, {tuple(w1.shape)}, "
                         f"{tuple(w2.shape)}")
    n_experts, dim, width = w1.shape
    gated = is_gated(activation)
    inner = width // 2 if gated else width
    if w2.shape != (n_experts, inner, dim) or x.shape[1] != dim or (gated and width % 2):
        raise ValueError(f"inconsistent expert shapes for {activation}: x {tuple(x.shape)}, w1 {tuple(w1.shape)}, "
                         f"w2 {tuple(w2.shape)} (want w1 [E,d,{'2n' if gated else 'n'}], w2 [E,n,d])")
    if (b1 is not None and b1.shape != (n_experts, width)) or (b2 is not None and b2.shape != (n_experts, dim)):
        raise ValueError(f"expert biases b1 {None if b1 is None else tuple(b1.shape)}, b2 "
                         f"{None if b2 is None else tuple(b2.shape)}: want [E,{width}] and [E,{dim}]")
    if routing.n_experts != n_experts:
        raise ValueError(f"routing has {routing.n_experts} experts, weights have {n_experts}")
    if routing.token_index.shape != routing.scores.shape or routing.token_index.dim() != 1:
        raise ValueError("routing.token_index and routing.scores must both be 1-D of the same length")


def _scatter_to_tokens(contrib_AD: Tensor, token_index_A: Tensor, n_tokens: int) -> Tensor:
    """out[t] = sum of contrib rows whose token is t; summed in float32 for low-precision inputs."""
    acc_dtype = torch.float32 if contrib_AD.dtype in (torch.bfloat16, torch.float16) else contrib_AD.dtype
    out_TD = torch.zeros(n_tokens, contrib_AD.shape[1], dtype=acc_dtype, device=contrib_AD.device)
    # index_put(accumulate=True) saves only the indices for backward; index_add would also save
    # the A x D source, inflating the standard-autograd baseline. It was also the faster on CPU.
    out_TD = out_TD.index_put((token_index_A,), contrib_AD.to(acc_dtype), accumulate=True)
    return out_TD.to(contrib_AD.dtype)


def _experts_loop(x_TD: Tensor, routing: Routing, w1_EDN: Tensor, w2_EFD: Tensor, activation: Activation,
                  b1_EN: Tensor | None = None, b2_ED: Tensor | None = None) -> Tensor:
    """Reference: one expert at a time, plain matmuls, standard autograd."""
    sizes = host_counts(routing.counts, routing.n_assignments)
    n_experts = w1_EDN.shape[0]
    b1s = b1_EN.unbind(0) if b1_EN is not None else (None,) * n_experts
    b2s = b2_ED.unbind(0) if b2_ED is not None else (None,) * n_experts
    pieces = []
    # Empty experts run too (zero-row matmuls) so every weight gets a zero gradient, never None.
    for tokens, scores, w1_DN, w2_FD, b1_N, b2_D in zip(routing.token_index.split(sizes),
                                                        routing.scores.split(sizes), w1_EDN.unbind(0),
                                                        w2_EFD.unbind(0), b1s, b2s, strict=True):
        hidden = x_TD[tokens] @ w1_DN
        expert_out = activation_forward(hidden if b1_N is None else hidden + b1_N, activation) @ w2_FD
        if b2_D is not None:
            expert_out = expert_out + b2_D
        pieces.append(expert_out * scores.unsqueeze(1).to(expert_out.dtype))
    return _scatter_to_tokens(torch.cat(pieces), routing.token_index, x_TD.shape[0])


def _experts_grouped(x_TD: Tensor, routing: Routing, w1_EDN: Tensor, w2_EFD: Tensor, activation: Activation,
                     backend: Backend, b1_EN: Tensor | None = None, b2_ED: Tensor | None = None,
                     float8: bool = False) -> Tensor:
    """Gather, two grouped GEMMs, weight by score, scatter back; standard autograd saves the lot."""
    sizes = host_counts(routing.counts, routing.n_assignments) if backend == "segment_loop" else None
    mm = Float8GroupedMM.apply if float8 else grouped_mm
    gathered_AD = x_TD.index_select(0, routing.token_index)
    hidden_AN = mm(gathered_AD, w1_EDN, routing.counts, backend, sizes)
    experts_A = expert_of_rows(routing.counts, routing.n_assignments) if b1_EN is not None or b2_ED is not None \
        else None
    if b1_EN is not None:
        hidden_AN = hidden_AN + b1_EN.index_select(0, experts_A)
    expert_out_AD = mm(activation_forward(hidden_AN, activation), w2_EFD, routing.counts, backend, sizes)
    if b2_ED is not None:
        expert_out_AD = expert_out_AD + b2_ED.index_select(0, experts_A)
    weighted_AD = expert_out_AD * routing.scores.unsqueeze(1).to(expert_out_AD.dtype)
    return _scatter_to_tokens(weighted_AD, routing.token_index, x_TD.shape[0])


def few_token_experts(x_TD: Tensor, topk_idx_TK: Tensor, gates_TK: Tensor, w1_EDN: Tensor, w2_EFD: Tensor,
                      activation: Activation, b1: Tensor | None = None, b2: Tensor | None = None) -> Tensor:
    """Inference on few tokens (no autograd): out[t] = sum_k gates[t, k] * expert_{idx[t, k]}(x_t), token by token.

    The MoE layer's path for generation's decode steps (`FEW_ASSIGNMENTS`): straight from the top-k
    choice, no grouping by expert; the same function as `routed_experts` of the top-k's `Routing`.
    """
    dtype = x_TD.dtype
    acc_dtype = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    # A decode step is a few GEMVs, so the Python calls around them count: casts only where a dtype
    # differs, one split for the rows and gates, and each token's sum starts from its first weighted
    # expert output (0 + a·g = a·g exactly) instead of a zeroed buffer.
    w1_EDN, w2_EFD = (w if w.dtype == dtype else w.to(dtype) for w in (w1_EDN, w2_EFD))
    b1_EN, b2_ED = (b if b is None or b.dtype == dtype else b.to(dtype) for b in (b1, b2))
    if gates_TK.dtype != acc_dtype:
        gates_TK = gates_TK.to(acc_dtype)
    top_k = topk_idx_TK.shape[1]
    x_rows, gate_cells = x_TD.split(1), gates_TK.reshape(-1, 1).split(1)  # [1, D] each; [1, 1] each
    out_rows = []
    for token, experts in enumerate(topk_idx_TK.tolist()):
        out_1D = None
        for slot, expert in enumerate(experts):
            hidden = x_rows[token] @ w1_EDN[expert]
            if b1_EN is not None:
                hidden = hidden + b1_EN[expert]
            expert_out = activation_forward(hidden, activation) @ w2_EFD[expert]
            if b2_ED is not None:
                expert_out = expert_out + b2_ED[expert]
            if expert_out.dtype != acc_dtype:
                expert_out = expert_out.to(acc_dtype)
            gate = gate_cells[token * top_k + slot]
            out_1D = expert_out * gate if out_1D is None else out_1D.addcmul_(expert_out, gate)
        out_rows.append(out_1D)
    if len(out_rows) == 1:
        out_TD = out_rows[0]
    else:  # several tokens, or none
        out_TD = torch.cat(out_rows) if out_rows else torch.zeros(x_TD.shape, dtype=acc_dtype, device=x_TD.device)
    return out_TD if out_TD.dtype == dtype else out_TD.to(dtype)


def routed_experts(x: Tensor, routing: Routing, w1: Tensor, w2: Tensor, activation: Activation = "swiglu",
                   impl: str = "memory_efficient", backend: Backend | None = None, b1: Tensor | None = None,
                   b2: Tensor | None = None, float8: bool = False) -> Tensor:
    """out[t] = sum over assignments a of token t: scores[a] * (phi(x_t W1_e + b1_e) W2_e + b2_e), shape [T,d].

    x [T,d]; w1 [E,d,2n] (gated: swiglu, ClampedSwiGLU) or [E,d,n] (gelu); w2 [E,n,d]; optional
    biases b1 [E, width of w1], b2 [E,d]. `backend` overrides the per-device grouped GEMM choice
    (the benchmark measures both). `float8`: the GEMMs in torchao's rowwise float8 grouped recipe (not the loop's).
    """
    if impl not in IMPLS:
        raise ModelError(f"moe impl = {impl!r} is invalid: valid impls are {', '.join(IMPLS)}")
    if float8 and impl == "loop":
        raise ModelError("float8 routed experts need moe impl = grouped or memory_efficient: the loop is the reference")
    if backend is not None and backend not in BACKENDS:
        raise ModelError(f"grouped GEMM backend = {backend!r} is invalid: valid backends are {', '.join(BACKENDS)}")
    check_expert_shapes(x, routing, w1, w2, activation, b1, b2)
    # Weights kept in a wider dtype than the activations (e.g. fp32 master weights, bf16 compute) are
    # cast differentiably here, so every implementation sees one dtype.
    w1_EDN, w2_EFD = w1.to(x.dtype), w2.to(x.dtype)
    b1_EN, b2_ED = (None if b is None else b.to(x.dtype) for b in (b1, b2))
    chosen = grouped_mm_backend(x.device, x.dtype, impl) if backend is None else backend
    if impl == "loop":
        return _experts_loop(x, routing, w1_EDN, w2_EFD, activation, b1_EN, b2_ED)
    if impl == "grouped":
        return _experts_grouped(x, routing, w1_EDN, w2_EFD, activation, chosen, b1_EN, b2_ED, float8)
    return memory_efficient_experts(x, routing, w1_EDN, w2_EFD, activation, chosen, b1=b1_EN, b2=b2_ED, float8=float8)
