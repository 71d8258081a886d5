"""Shared transformer layers: RoPE, document masking, grouped-query attention, SwiGLU feed-forward.

These are the building blocks both the transformer (transformer.py) and the MoE layer (moe.py,
for its shared expert) use; parameter names inside each layer (`wq`, `wk`, `wv`, `wo`, `w1`,
`w2`, `w3`) follow torchtitan so init schemes, sharding and checkpoints can match by name.
This module sits at the bottom of `moetrain.model`: it imports no other model module, holds
no initialisation (init.py fills the parameters) and no distributed code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moetrain.config import ModelConfig


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos/sin of the rotation angles, float32, shape [*positions.shape, head_dim // 2].

    Channel pair j (channels 2j, 2j+1) rotates by angle position * theta^(-2j / head_dim).
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each channel pair (2j, 2j+1) of x [B, S, H, D] by the angles of cos/sin [B, S, D/2].

    Computed in float32 and cast back, like torchtitan's complex-number form (same pairing).
    """
    xf = x.float().unflatten(-1, (-1, 2))
    even, odd = xf[..., 0], xf[..., 1]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over heads
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


def positions_from_documents(document_ids: Tensor) -> Tensor:
    """Position of each token inside its own document (restarts at 0 where the id changes).

    Documents are contiguous runs of equal ids along the sequence dimension.
    """
    batch, seq = document_ids.shape
    index = torch.arange(seq, device=document_ids.device).expand(batch, seq)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    start_index = torch.where(starts, index, torch.zeros_like(index))
    return index - torch.cummax(start_index, dim=1).values


def document_causal_mask(document_ids: Tensor) -> Tensor:
    """Boolean mask [B, 1, S, S]: True where query i may attend key j (same document, j <= i)."""
    seq = document_ids.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
    same_doc = document_ids.unsqueeze(-1) == document_ids.unsqueeze(-2)
    return (same_doc & causal).unsqueeze(1)


class Attention(nn.Module):
    """Multi-head attention with grouped-query heads (n_kv_heads divides n_heads), RoPE and SDPA."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads or cfg.n_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.rope_theta = cfg.rope_theta
        self.wq = nn.Linear(cfg.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: Tensor, positions: Tensor, mask: Tensor | None) -> Tensor:
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim)
        k = self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        repeats = self.n_heads // self.n_kv_heads
        if repeats > 1:  # each kv head serves `repeats` consecutive query heads
            k = k.repeat_interleave(repeats, dim=2)
            v = v.repeat_interleave(repeats, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, D]
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); w1 is the gate, w3 the up projection, w2 the down projection."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
