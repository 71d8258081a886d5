"""The GEMM attention: softmax attention as batched matrix products, which `attention.attend` takes on CPU.

scores = q·kᵀ in batched GEMMs over causal query chunks, torch's fused masked softmax (float32 inside),
then probs @ v; the backward from the saved probabilities in four more GEMMs. It serves float32 and bf16
on CPU below a size bound on the scores; masks, windows and sinks come from `attention`, which decides
when to call it. This module computes one call; it must not plan masks or choose a method.
"""

from __future__ import annotations

import torch
from torch import Tensor

# The GEMM attention (CPU training and evaluation at short and medium lengths): scores = q·kᵀ in batched
# matmuls, the masked softmax (torch's fused kernel, float32 inside), then probs @ v; the backward from
# the saved probabilities in four more matmuls. SDPA's CPU flash kernel ran at about 35 GFLOP/s in float32
# and bf16 alike at [2, 16, 512, 128] on the dev machine's EPYC, where a bf16 GEMM reaches 170-200
# (docs/design/performance.md): materialising the scores wins there. It is taken only while one call's
# scores, B·H·L·Lk, hold at most GEMM_ATTENTION_MAX_SCORES elements (2^24: 32 MiB of bf16 probabilities
# saved per layer, 64 MiB in float32; [2, 16, 512, 512] is 2^23), so long rows keep the flash kernel's
# linear memory; only for float32 and bf16 on CPU (float64 stays on SDPA, the tests' reference).
GEMM_ATTENTION_MAX_SCORES = 1 << 24
GEMM_ATTENTION_DTYPES = (torch.float32, torch.bfloat16)
# Queries per chunk: chunk [a, b) needs keys up to b + Lk - L only (every mask here is causal), so the
# chunks skip the upper triangle's blocks: at L = 512, 4 chunks compute 10/16 of the square.
GEMM_ATTENTION_CHUNK = 128


def use_gemm_attention(q: Tensor, keys: int) -> bool:
    batch, length, heads, _ = q.shape
    return (q.device.type == "cpu" and q.dtype in GEMM_ATTENTION_DTYPES
            and batch * heads * length * keys <= GEMM_ATTENTION_MAX_SCORES)


def _query_chunks(length: int, keys: int) -> list[tuple[int, int, int]]:
    """(first query, end query, keys it needs) per chunk; the queries are the last L of the Lk positions."""
    offset = keys - length
    return [(a, min(a + GEMM_ATTENTION_CHUNK, length), min(a + GEMM_ATTENTION_CHUNK, length) + offset)
            for a in range(0, length, GEMM_ATTENTION_CHUNK)]


def gemm_attention_saved_keys(batch: int, heads: int, length: int, dtype: torch.dtype,
                              device_type: str = "cpu") -> float:
    """Probabilities the GEMM attention saves per query and head on a causal [batch, length] call (its
    chunks' key counts averaged over the queries); 0 when such a call takes SDPA instead."""
    if device_type != "cpu" or dtype not in GEMM_ATTENTION_DTYPES or batch * heads * length * length > \
            GEMM_ATTENTION_MAX_SCORES:
        return 0.0
    return sum((b - a) * needed for a, b, needed in _query_chunks(length, length)) / max(length, 1)


class GemmAttention(torch.autograd.Function):
    """Softmax attention of q [N, L, H, D] over k [N, Lk, G, D], v [N, Lk, G, Dv] as batched GEMMs in the inputs' dtype.

    `allowed` [N or 1, 1, L, Lk] bool (None: causal) must lie inside the causal triangle aligned to the
    last key (query i sees no key after i + Lk - L; every mask of this module does). `sinks` [H] or
    None: one extra logit per head in the denominator. Grouped-query heads h = g·r + i share kv head
    g: a query chunk is laid out as [N·G, r·Lc, D], so one GEMM per kv head serves its r query heads,
    and dk, dv come out summed over them. The scale 1/√D rides on the GEMM (alpha, applied to the
    float32 accumulator before the one rounding of the scores); softmax and its backward are torch's
    fused kernels, which accumulate in float32 for bf16 and round the probabilities once to the
    compute dtype: what the value product reads (as in the flash kernel) and what the backward saves
    instead of recomputing the scores. Sinks take a float32 path of their own.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None, sinks: Tensor | None) -> Tensor:
        n, length, heads, head_dim = q.shape
        keys, groups, value_dim = k.shape[1], k.shape[2], v.shape[3]
        rep = heads // groups
        scale = head_dim ** -0.5
        q_g = q.permute(0, 2, 1, 3).reshape(n * groups, rep, length, head_dim)
        k_g = k.transpose(1, 2).reshape(n * groups, keys, head_dim)
        v_g = v.transpose(1, 2).reshape(n * groups, keys, value_dim)
        if allowed is None:
            allowed = torch.ones(length, keys, dtype=torch.bool, device=q.device).tril(keys - length)
        allowed = allowed.view(-1, 1, 1, length, keys)
        out_g = q.new_empty(n * groups, rep, length, value_dim)
        empty = q.new_empty(())
        saved_probs, sink_probs = [], []
        for a, b, needed in _query_chunks(length, keys):
            rows = rep * (b - a)
            q_c = q_g[:, :, a:b].reshape(n * groups, rows, head_dim)
            scores = torch.baddbmm(empty, q_c, k_g[:, :needed].transpose(1, 2), beta=0.0, alpha=scale)
            # Out of place: selective activation checkpointing may keep the GEMM's output, which must not change.
            scores_5d = scores.view(n, groups, rep, b - a, needed).masked_fill(~allowed[..., a:b, :needed],
                                                                              float("-inf"))
            scores = scores_5d.view(n * groups, rows, needed)
            if sinks is None:
                probs = torch.softmax(scores, dim=-1)
            else:  # softmax over [scores, sink], the sink's column dropped: in float32, then rounded once
                logits = scores_5d.float()
                sink = sinks.detach().float().view(1, groups, rep, 1, 1)
                top = torch.maximum(logits.amax(dim=-1, keepdim=True), sink)
                logits.sub_(top).exp_()
                denominator = logits.sum(dim=-1, keepdim=True)
                sink_prob = (sink - top).exp_()
                denominator.add_(sink_prob)
                sink_probs.append(sink_prob.div_(denominator))  # [N, G, r, Lc, 1]: the sink's share
                probs = logits.div_(denominator).to(q.dtype).view(n * groups, rows, needed)
            out_g[:, :, a:b] = torch.bmm(probs, v_g[:, :needed]).view(n * groups, rep, b - a, value_dim)
            saved_probs.append(probs)
        ctx.save_for_backward(q_g, k_g, v_g, out_g if sinks is not None else None, *saved_probs, *sink_probs)
        ctx.shape = (n, length, heads, head_dim, rep, len(saved_probs))
        ctx.sinks_dtype = None if sinks is None else sinks.dtype
        # [N, L, H, Dv] laid out as the caller reshapes it (the one copy SDPA's transposed output costs too)
        return out_g.view(n, heads, length, value_dim).transpose(1, 2).contiguous()

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        n, length, heads, head_dim, rep, n_chunks = ctx.shape
        q_g, k_g, v_g, out_g, *rest = ctx.saved_tensors
        saved_probs, sink_probs = rest[:n_chunks], rest[n_chunks:]
        groups, keys, value_dim = heads // rep, k_g.shape[1], v_g.shape[2]
        scale = head_dim ** -0.5
        dtype = q_g.dtype
        grad_g = grad_out.to(dtype).transpose(1, 2).reshape(n * groups, rep, length, value_dim)
        grad_q = torch.empty_like(q_g)
        grad_k = k_g.new_zeros(k_g.shape)
        grad_v = v_g.new_zeros(v_g.shape)
        grad_sinks = None if ctx.sinks_dtype is None else torch.zeros(heads, dtype=torch.float32, device=q_g.device)
        for index, (a, b, needed) in enumerate(_query_chunks(length, keys)):
            rows = rep * (b - a)
            probs = saved_probs[index]
            q_c = q_g[:, :, a:b].reshape(n * groups, rows, head_dim)
            grad_c = grad_g[:, :, a:b].reshape(n * groups, rows, value_dim)
            grad_v[:, :needed].baddbmm_(probs.transpose(1, 2), grad_c)  # summed over the r heads and the chunks
            grad_probs = torch.bmm(grad_c, v_g[:, :needed].transpose(1, 2))
            if ctx.sinks_dtype is None:
                grad_scores = torch._softmax_backward_data(grad_probs, probs, -1, dtype)
            else:  # dS = P ⊙ (dP - δ), δ = Σ_j P_j dP_j = <dO, O>; the sink's value is 0: dS_sink = -P_sink·δ
                out_c = out_g[:, :, a:b].reshape(n * groups, rows, value_dim)
                delta = (grad_c.float() * out_c.float()).sum(dim=-1, keepdim=True)
                grad_scores = grad_probs.float().sub_(delta).mul_(probs).to(dtype)
                share = sink_probs[index].view(n, heads, b - a) * delta.view(n, heads, b - a)
                grad_sinks.sub_(share.sum(dim=(0, 2)))
            grad_q[:, :, a:b] = torch.baddbmm(q_g.new_empty(()), grad_scores, k_g[:, :needed], beta=0.0,
                                              alpha=scale).view(n * groups, rep, b - a, head_dim)
            grad_k[:, :needed].baddbmm_(grad_scores.transpose(1, 2), q_c, alpha=scale)
        grad_q = grad_q.view(n, heads, length, head_dim).transpose(1, 2)
        grad_k = grad_k.view(n, groups, keys, head_dim).transpose(1, 2)
        grad_v = grad_v.view(n, groups, keys, value_dim).transpose(1, 2)
        return grad_q, grad_k, grad_v, None, None if grad_sinks is None else grad_sinks.to(ctx.sinks_dtype)
