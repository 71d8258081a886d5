"""Shared transformer layers: RoPE, document positions, grouped-query attention, SwiGLU feed-forward.

These are the building blocks both the transformer (transformer.py) and the MoE layer (moe.py,
for its shared expert) use; parameter names inside each layer (`wq`, `wk`, `wv`, `wo`, `q_norm`,
`k_norm`, `w1`, `w2`, `w3`) follow torchtitan so init schemes, sharding and checkpoints can match
by name. Attention supports a free head width, QK-norm (per head or over the full projected
width), both RoPE channel layouts and q/k/v clipping, which the Hugging Face families need.
The attention computation itself (document masking and its methods) lives in attention.py; this
module imports no other model module but that one, holds no initialisation (init.py fills the
parameters) and no distributed code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.profiler import record_function

from moetrain.config import ModelConfig
from moetrain.model.attention import AttentionPlan, attend

ROPE_LAYOUTS = ("interleaved", "half")


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos/sin of the rotation angles, float32, shape [*positions.shape, head_dim // 2].

    Frequency j rotates by angle position * theta^(-2j / head_dim); written as 1 / theta^(2j / head_dim)
    like Hugging Face's default RoPE so both compute bit-identical angles.
    """
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, layout: str = "interleaved") -> Tensor:
    """Rotate the channel pairs of x [B, S, H, D] by the angles of cos/sin [B, S, D/2].

    Frequency j acts on channels (2j, 2j+1) in the "interleaved" layout (torchtitan's complex-number
    form) and on (j, j + D/2) in the "half" layout (Hugging Face's rotate_half). Computed in at least
    float32 and cast back.
    """
    dtype = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(dtype)
    cos, sin = cos.to(dtype).unsqueeze(-2), sin.to(dtype).unsqueeze(-2)  # broadcast over heads
    if layout == "interleaved":
        pairs = xf.unflatten(-1, (-1, 2))
        first, second = pairs[..., 0], pairs[..., 1]
        rotated = torch.stack((first * cos - second * sin, first * sin + second * cos), dim=-1).flatten(-2)
    elif layout == "half":
        first, second = xf.chunk(2, dim=-1)
        rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    else:
        raise ValueError(f"rope layout {layout!r} is not one of {ROPE_LAYOUTS}")
    return rotated.type_as(x)


def rope_permutation(head_dim: int) -> Tensor:
    """Channel order taking a "half"-layout head to the "interleaved" layout: interleaved = half[perm].

    Applied to the rows of each head of wq/wk (and to per-channel QK-norm weights) it makes an
    interleaved-RoPE model compute exactly what the half-layout model computes: q·k is invariant
    under one permutation applied to both, and v is untouched.
    """
    half = head_dim // 2
    return torch.stack((torch.arange(half), torch.arange(half) + half), dim=-1).flatten()


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


class Attention(nn.Module):
    """Multi-head attention: grouped-query heads (n_kv_heads divides n_heads), optional QK-norm, RoPE.

    The document-masked attention runs by the forward's plan (attention.plan_attention).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads or cfg.n_heads
        self.head_dim = cfg.attention_head_dim()
        self.rope_theta = cfg.rope_theta
        self.rope_layout = cfg.rope_layout
        self.qk_norm = cfg.qk_norm
        self.clip_qkv = cfg.clip_qkv
        self.wq = nn.Linear(cfg.dim, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, cfg.dim, bias=False)
        if cfg.qk_norm == "per_head":  # one weight of head_dim, shared by every head (Qwen3)
            self.q_norm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps)
        elif cfg.qk_norm == "full":  # over all heads' channels at once (OLMoE)
            self.q_norm = nn.RMSNorm(self.n_heads * self.head_dim, eps=cfg.norm_eps)
            self.k_norm = nn.RMSNorm(self.n_kv_heads * self.head_dim, eps=cfg.norm_eps)

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q [B, S, H, D], k and v [B, S, H_kv, D]: projected, QK-normed and clipped, before RoPE."""
        batch, seq, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(batch, seq, self.n_heads, self.head_dim)
        k = k.view(batch, seq, self.n_kv_heads, self.head_dim)
        v = v.view(batch, seq, self.n_kv_heads, self.head_dim)
        if self.qk_norm == "per_head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        return q, k, v

    def forward(self, x: Tensor, positions: Tensor, plan: AttentionPlan | None = None) -> Tensor:
        batch, seq, _ = x.shape
        q, k, v = self._project(x)
        cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_theta)
        q, k = apply_rope(q, cos, sin, self.rope_layout), apply_rope(k, cos, sin, self.rope_layout)
        with record_function("attention"):  # a label in profiler traces
            return self.wo(attend(q, k, v, plan).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); w1 is the gate, w3 the up projection, w2 the down projection."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
