"""Multi-head latent attention (MLA, DeepSeek-V2 arXiv 2405.04434 / V3 arXiv 2412.19437).

Queries: x -> `wq` (full projection, `q_lora_rank` None) or x -> `wq_a` -> `q_a_norm` (RMSNorm) ->
`wq_b` (low-rank path), [H, qk_nope_head_dim + qk_rope_head_dim] per token. Keys and values: x ->
`wkv_a` -> [kv_lora_rank latent | qk_rope_head_dim RoPE key]; the latent is RMSNorm-ed
(`kv_a_norm`) and expanded by `wkv_b` to [H, qk_nope_head_dim + v_head_dim] (per-head key part
without position | value); the one RoPE key part is shared by every head. RoPE (optionally YaRN)
rotates the rope channels of q and k in `cfg.rope_layout` ("interleaved" is DeepSeek's
`rope_interleave = true`: the files' own row order). The softmax scale is qk_head_dim^-0.5,
times mscale(factor, rope_yarn_mscale_all_dim)^2 under YaRN, as DeepSeek-V3 computes it.

The attention itself is `attention.attend` unchanged: its SDPA scale is 1/sqrt(q width) =
qk_head_dim^-0.5, so the YaRN factor is applied to q beforehand; since its methods expect one
head width, values narrower than the query heads are zero-padded to it (the padded output
channels are zero and are cut), and in the rarer opposite case q and k are zero-padded and q
rescaled for the wider SDPA scale. The parameters are named so `init.classify` and the Hugging
Face maps (`interop.families.deepseek_v3`) find them.

Generation (`forward(..., cache=)`, model/kv_cache.py) caches each head's decompressed key (nope |
rope, after RoPE) and value, the same tensors the re-running path attends over (the padding to one
head width is not needed there: the cache's SDPA takes values of their own width), so both paths
compute the same products, up to the attention kernel's summation order. Caching the compressed
latent instead (kv_lora_rank + rope channels a token, with wkv_b absorbed into the query and the
output) would hold less, but reorders the products and so is not what the re-running path computes.
This module holds no initialisation and no distributed code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moetrain.config.model import ModelConfig
from moetrain.model.attention import AttentionPlan, attend, max_logit_per_head
from moetrain.model.kv_cache import LayerCache
from moetrain.model.layers import apply_rope, rope_cos_sin, yarn_mscale

# DeepSeek's latent RMSNorms (q_a_layernorm, kv_a_layernorm) use this epsilon whatever rms_norm_eps says.
LATENT_NORM_EPS = 1e-6


class MultiHeadLatentAttention(nn.Module):
    """MLA on x [B, S, d] -> [B, S, d]; same forward arguments as `layers.Attention`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.kv_lora_rank is None:
            raise ValueError("MultiHeadLatentAttention needs model.kv_lora_rank")
        self.n_heads = cfg.n_heads
        self.q_lora_rank, self.kv_lora_rank = cfg.q_lora_rank, cfg.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.qk_head_dim = self.nope_dim + self.rope_dim
        self.rope_theta, self.rope_layout, self.rope_cfg = cfg.rope_theta, cfg.rope_layout, cfg
        # Extra factor on the softmax scale beyond SDPA's qk_head_dim^-0.5 (YaRN's mscale_all_dim, squared).
        self.q_scale = (yarn_mscale(cfg.rope_yarn_factor, cfg.rope_yarn_mscale_all_dim) ** 2
                        if cfg.rope_scaling == "yarn" and cfg.rope_yarn_mscale_all_dim else 1.0)
        q_width = self.n_heads * self.qk_head_dim
        if self.q_lora_rank is None:
            self.wq = nn.Linear(cfg.dim, q_width, bias=False)
        else:
            self.wq_a = nn.Linear(cfg.dim, self.q_lora_rank, bias=False)
            self.q_a_norm = nn.RMSNorm(self.q_lora_rank, eps=LATENT_NORM_EPS)
            self.wq_b = nn.Linear(self.q_lora_rank, q_width, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_norm = nn.RMSNorm(self.kv_lora_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(self.kv_lora_rank, self.n_heads * (self.nope_dim + self.v_dim), bias=False)
        self.wo = nn.Linear(self.n_heads * self.v_dim, cfg.dim, bias=False)
        self.max_logits: Tensor | None = None  # [H] while QK-clip records this step's largest logits (train/qk_clip.py)

    def forward(self, x: Tensor, positions: Tensor, plan: AttentionPlan | None = None,
                cache: LayerCache | None = None) -> Tensor:
        """`cache` (generation): store this forward's per-head k/v, attend over every cached token instead of `plan`."""
        batch, seq, _ = x.shape
        q = self.wq(x) if self.q_lora_rank is None else self.wq_b(self.q_a_norm(self.wq_a(x)))
        q_nope, q_rope = q.view(batch, seq, -1, self.qk_head_dim).split([self.nope_dim, self.rope_dim], -1)
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        # Heads from the widths (-1): under tensor parallelism wq(_b), wkv_b and wo hold this rank's heads only.
        kv = self.wkv_b(self.kv_a_norm(latent)).view(batch, seq, -1, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        cos, sin = rope_cos_sin(positions, self.rope_dim, self.rope_theta, self.rope_cfg)
        q_rope = apply_rope(q_rope, cos, sin, self.rope_layout)
        k_rope = apply_rope(k_rope.unsqueeze(2), cos, sin, self.rope_layout)  # [B, S, 1, rope]: one for all heads
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, -1, k_nope.shape[2], -1)), dim=-1)
        if cache is not None:  # SDPA's scale there is 1/sqrt(q width) = qk_head_dim^-0.5, v keeps its width
            out = cache.attend(q * self.q_scale if self.q_scale != 1.0 else q, k, v)
            return self.wo(out.reshape(batch, seq, -1))
        # attend() wants one head width; zero channels add nothing to q·k or to the output (cut after).
        width = max(self.qk_head_dim, self.v_dim)
        scale = self.q_scale
        if self.v_dim < width:
            v = F.pad(v, (0, width - self.v_dim))
        if self.qk_head_dim < width:
            q, k = F.pad(q, (0, width - self.qk_head_dim)), F.pad(k, (0, width - self.qk_head_dim))
            scale *= (width / self.qk_head_dim) ** 0.5  # SDPA divides by sqrt(width), not sqrt(qk_head_dim)
        if scale != 1.0:
            q = q * scale
        if self.max_logits is not None:
            self.max_logits = torch.maximum(self.max_logits, max_logit_per_head(q, k, plan))
        out = attend(q, k, v, plan)[..., :self.v_dim]
        return self.wo(out.reshape(batch, seq, -1))
