"""Shared transformer layers: RoPE, document positions, grouped-query attention, SwiGLU feed-forward.

These are the building blocks both the transformer (transformer.py) and the MoE layer (moe.py,
for its shared expert) use; parameter names inside each layer (`wq`, `wk`, `wv`, `wo`, `q_norm`,
`k_norm`, `w1`, `w2`, `w3`) follow torchtitan so init schemes, sharding and checkpoints can match
by name. Attention supports a free head width, QK-norm (per head or over the full projected
width), both RoPE channel layouts, q/k/v clipping, projection biases, learned attention sinks
(`sinks` [n_heads]) and a per-layer sliding window, which the Hugging Face families need.
The attention computation itself (document masking and its methods) lives in attention.py, and
generation's cached attention in kv_cache.py (`Attention.forward(..., cache=)`); this module imports
no other model module but those two, holds no initialisation (init.py fills the parameters) and no
distributed code.
"""

from __future__ import annotations

import math
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.profiler import record_function

from moetrain.config.model import ModelConfig
from moetrain.model.attention import AttentionPlan, attend, max_logit_per_head
from moetrain.model.kv_cache import LayerCache

ROPE_LAYOUTS = ("interleaved", "half")


def profiler_label(name: str) -> AbstractContextManager:
    """`record_function(name)` while a profiler records (or under compile), else nothing.

    Entering a record_function costs a dispatched op even with no profiler running, which is a
    large share of a one-token decode step; the labels only matter in a trace.
    """
    if torch.compiler.is_compiling() or torch.autograd._profiler_enabled():
        return record_function(name)
    return nullcontext()


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 · mscale · ln(scale) + 1 (1 when scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(rotary_dim: int, theta: float, cfg: ModelConfig | None = None,
                  device: torch.device | None = None) -> tuple[Tensor, float]:
    """(inverse frequencies [rotary_dim // 2] float32, factor cos/sin are multiplied by).

    Default RoPE: frequency j is theta^(-2j / rotary_dim), written as 1 / theta^(2j / rotary_dim) like
    Hugging Face so both compute bit-identical angles; factor 1. Under `cfg.rope_scaling = "yarn"`
    (arXiv 2309.00071, as transformers' `_compute_yarn_parameters` computes it): frequencies
    blend the original ones (high frequencies, extrapolated) with ones divided by the factor (low
    frequencies, interpolated) along a linear ramp between the channels where the original context
    makes beta_fast and beta_slow rotations; the factor is the YaRN mscale ratio.
    """
    pos_freqs = theta ** (torch.arange(0, rotary_dim, 2, device=device, dtype=torch.int64).float() / rotary_dim)
    inv_freq = 1.0 / pos_freqs
    if cfg is None or cfg.rope_scaling == "none":
        return inv_freq, 1.0
    factor, original = cfg.rope_yarn_factor, cfg.rope_yarn_original_max_seq_len
    mscale, mscale_all_dim = cfg.rope_yarn_mscale, cfg.rope_yarn_mscale_all_dim
    attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim
                        else yarn_mscale(factor))

    def correction_dim(rotations: float) -> float:
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(cfg.rope_yarn_beta_fast), correction_dim(cfg.rope_yarn_beta_slow)
    if cfg.rope_yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # as transformers does, against a zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq, float(attention_factor)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float,
                 cfg: ModelConfig | None = None) -> tuple[Tensor, Tensor]:
    """cos/sin of the rotation angles, float32, shape [*positions.shape, head_dim // 2].

    `head_dim` is the number of rotated channels; `cfg` (optional) brings the RoPE scaling
    (`rope_inv_freq`), whose factor multiplies cos and sin as transformers does.
    """
    inv_freq, factor = rope_inv_freq(head_dim, theta, cfg, positions.device)
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    if factor == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * factor, angles.sin() * factor


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


def apply_partial_rope(x: Tensor, cos: Tensor, sin: Tensor, layout: str = "interleaved") -> Tensor:
    """`apply_rope` on the first 2 · cos.shape[-1] channels of each head of x; the rest pass unchanged."""
    rotary = 2 * cos.shape[-1]
    if rotary == x.shape[-1]:
        return apply_rope(x, cos, sin, layout)
    return torch.cat((apply_rope(x[..., :rotary], cos, sin, layout), x[..., rotary:]), dim=-1)


def rope_rotation(positions: Tensor, head_dim: int, rotary_dim: int, theta: float, cfg: ModelConfig | None = None,
                  layout: str = "interleaved", dtype: torch.dtype = torch.float32) -> Tensor:
    """RoPE at `positions` [B, S] as matrices [B, S, head_dim, head_dim] in `dtype`: x @ R = apply_partial_rope(x).

    RoPE is linear in each head's channels, so its matrix is the rotation of the identity's rows.
    Generation's one-token steps use it: one matmul per q and k instead of a dozen elementwise ops.
    """
    cos, sin = rope_cos_sin(positions, rotary_dim, theta, cfg)
    identity = torch.eye(head_dim, dtype=dtype, device=positions.device)
    return apply_partial_rope(identity.expand(*positions.shape, head_dim, head_dim), cos, sin, layout)


# A decode step takes its RoPE matrices from a table over every slot of the KV cache, made once per
# generation, while the table stays under this many elements (16 MiB in float32); else it makes the
# matrices of the step's positions once per step.
ROPE_TABLE_ELEMENTS = 1 << 22


def decode_rope_rotation(cache: LayerCache, positions: Tensor, head_dim: int, rotary_dim: int, theta: float,
                         cfg: ModelConfig | None, layout: str, dtype: torch.dtype) -> Tensor:
    """`rope_rotation` at a decode step's `positions` [B, S] (one or a few tokens), shared by every layer of equal
    RoPE settings."""
    key = ("rope", head_dim, rotary_dim, theta, layout, id(cfg), dtype)

    def at_positions() -> Tensor:  # the first layer of a forward asks; the others reuse its answer
        if cache.capacity * head_dim ** 2 > ROPE_TABLE_ELEMENTS:
            return rope_rotation(positions, head_dim, rotary_dim, theta, cfg, layout, dtype)
        table = cache.per_cache(key, lambda: rope_rotation(
            torch.arange(cache.capacity, device=positions.device).unsqueeze(0), head_dim, rotary_dim, theta, cfg,
            layout, dtype)[0])
        return table.index_select(0, positions.reshape(-1)).view(*positions.shape, head_dim, head_dim)

    return cache.per_forward(key, at_positions)


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

    The document-masked attention runs by the forward's plan (attention.plan_attention). The training
    forward takes its head counts from the projections' output widths, so it also runs on a slice of
    the heads (tensor parallelism gives each rank its own columns of wq, wk, wv and rows of wo).
    """

    def __init__(self, cfg: ModelConfig, layer_id: int = 0):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads or cfg.n_heads
        self.head_dim = cfg.attention_head_dim()
        self.rope_theta = cfg.rope_theta
        self.rope_layout = cfg.rope_layout
        self.qk_norm = cfg.qk_norm
        self.clip_qkv = cfg.clip_qkv
        self.window = cfg.window_of(layer_id)  # None: the whole document
        self.rope_cfg = cfg  # the RoPE scaling fields
        self.rotary_dim = cfg.rotary_dim()  # the first channels of each head (partial rotary, GLM-4.5)
        qkv_bias, out_bias = cfg.attention_bias in ("qkv", "all"), cfg.attention_bias == "all"
        self.wq = nn.Linear(cfg.dim, self.n_heads * self.head_dim, bias=qkv_bias)
        self.wk = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.wv = nn.Linear(cfg.dim, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.wo = nn.Linear(self.n_heads * self.head_dim, cfg.dim, bias=out_bias)
        # One logit per query head in the softmax's denominator (attention.attend); None: no sinks.
        self.sinks = nn.Parameter(torch.empty(self.n_heads)) if cfg.attention_sinks else None
        self.max_logits: Tensor | None = None  # [H] while QK-clip records this step's largest logits (train/qk_clip.py)
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
        # Heads from the projections' widths, not the config: under tensor parallelism a rank's
        # projections hold its own heads only (moetrain.parallel.tensor_parallel).
        q = q.view(batch, seq, -1, self.head_dim)
        k = k.view(batch, seq, -1, self.head_dim)
        v = v.view(batch, seq, -1, self.head_dim)
        if self.qk_norm == "per_head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        return q, k, v

    def _project_decode(self, x: Tensor, cache: LayerCache) -> tuple[Tensor, Tensor, Tensor]:
        """`_project` of a decode step (x [B, S, d], one or a few tokens) in fewer calls, bit for bit the same (tested).

        On CPU in float32/64 with `cache.copy_weights` the three projections are one GEMV over
        wq | wk | wv, concatenated once per generation (each output is the same dot product; in
        bfloat16 the wider product was measured to round differently, so it keeps `_project`), and
        per-head QK-norm runs once over q's and k's heads together (torch.rms_norm's own steps, each
        head with its weight).
        """
        if not cache.copy_weights or x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64):
            return self._project(x)
        if any(type(p) is not nn.Linear for p in (self.wq, self.wk, self.wv)):  # LoRA: more than the weights
            return self._project(x)
        batch, seq, _ = x.shape
        heads, kv_heads, head_dim = self.n_heads, self.n_kv_heads, self.head_dim

        def fused() -> tuple[Tensor, Tensor | None]:
            weight = torch.cat((self.wq.weight, self.wk.weight, self.wv.weight)).detach()
            bias = None if self.wq.bias is None else torch.cat((self.wq.bias, self.wk.bias, self.wv.bias)).detach()
            return weight, bias

        weight, bias = cache.per_cache(("qkv", id(self)), fused)
        qkv = F.linear(x, weight, bias)
        if self.qk_norm == "full":
            q, k, v = qkv.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
            q, k = self.q_norm(q), self.k_norm(k)
            q, k = q.view(batch, seq, heads, head_dim), k.view(batch, seq, kv_heads, head_dim)
            v = v.view(batch, seq, kv_heads, head_dim)
        elif self.qk_norm == "per_head" and self.q_norm.eps is not None and self.q_norm.eps == self.k_norm.eps:
            qkv = qkv.view(batch, seq, heads + 2 * kv_heads, head_dim)
            qk, v = qkv.narrow(2, 0, heads + kv_heads), qkv.narrow(2, heads + kv_heads, kv_heads)
            norm_weight = cache.per_cache(("qk_norm", id(self)), lambda: torch.cat(
                (self.q_norm.weight.expand(heads, head_dim), self.k_norm.weight.expand(kv_heads, head_dim))).detach())
            # torch.rms_norm's steps: x · rsqrt(mean(x²) + eps) · weight
            qk = qk * torch.rsqrt(qk.pow(2).mean(-1, keepdim=True).add_(self.q_norm.eps)) * norm_weight
            q, k = qk.split((heads, kv_heads), dim=2)
        else:
            q, k, v = qkv.view(batch, seq, heads + 2 * kv_heads, head_dim).split((heads, kv_heads, kv_heads), dim=2)
            if self.qk_norm == "per_head":
                q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        return q, k, v

    def forward(self, x: Tensor, positions: Tensor, plan: AttentionPlan | None = None,
                cache: LayerCache | None = None) -> Tensor:
        """`cache` (generation): store this forward's k/v and attend over every cached token instead of `plan`."""
        batch, seq, _ = x.shape
        decode = cache is not None and cache.few  # one token, or a few (speculative decoding's verify forward)
        q, k, v = self._project_decode(x, cache) if decode else self._project(x)
        if not decode:
            cos, sin = rope_cos_sin(positions, self.rotary_dim, self.rope_theta, self.rope_cfg)
            q, k = (apply_partial_rope(t, cos, sin, self.rope_layout) for t in (q, k))
        else:  # a decode step: RoPE as one matrix per token, applied to its q's and k's heads by one bmm
            rotation = decode_rope_rotation(cache, positions, self.head_dim, self.rotary_dim, self.rope_theta,
                                            self.rope_cfg, self.rope_layout,
                                            torch.promote_types(q.dtype, torch.float32))  # as apply_rope computes
            qk = torch.cat((q, k), dim=2).view(batch * seq, -1, self.head_dim)
            if qk.dtype != rotation.dtype:
                qk = qk.to(rotation.dtype)
            qk = torch.bmm(qk, rotation.view(batch * seq, self.head_dim, self.head_dim))
            if qk.dtype != q.dtype:
                qk = qk.to(q.dtype)
            q, k = qk.view(batch, seq, -1, self.head_dim).split((self.n_heads, self.n_kv_heads), dim=2)
        with profiler_label("attention"):  # a label in profiler traces
            if cache is None:
                if self.max_logits is not None:
                    self.max_logits = torch.maximum(self.max_logits, max_logit_per_head(q, k, plan, self.window))
                out = attend(q, k, v, plan, self.sinks, self.window)
            else:
                out = cache.attend(q, k, v, window=self.window, sinks=self.sinks)
            return self.wo(out.reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); w1 is the gate, w3 the up projection, w2 the down projection."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
