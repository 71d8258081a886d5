"""Decoder-only transformer: RMSNorm, RoPE, grouped-query attention with document masking, SwiGLU FFN.

The first `n_dense_layers` blocks use a dense SwiGLU feed-forward, the rest an MoE layer
(`moetrain.model.moe.MoE`). Parameter names follow torchtitan (`tok_embeddings.weight`,
`layers.{i}.attention.wq.weight`, `layers.{i}.feed_forward.w1.weight`, `layers.{i}.moe.experts.w1`,
`norm.weight`, `output.weight`) so init schemes, sharding and checkpoints can match by name.

The model builds on any device, including `meta`; `init_weights()` fills every parameter and
buffer (after `to_empty` when built on meta). It knows nothing about distribution: FSDP is
applied from outside (`moetrain.parallel.shard`), and the init code handles DTensor shards.
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


class TransformerBlock(nn.Module):
    """Pre-norm block: h = x + attention(norm(x)); out = h + ffn(norm(h)). One unit for fully_shard."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        from moetrain.model.moe import MoE

        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.is_moe = layer_id >= cfg.n_dense_layers
        if self.is_moe:
            self.moe = MoE(cfg.dim, cfg.moe)
        else:
            self.feed_forward = FeedForward(cfg.dim, cfg.ffn_hidden)

    def forward(self, x: Tensor, positions: Tensor, mask: Tensor | None) -> Tensor:
        h = x + self.attention(self.attention_norm(x), positions, mask)
        ffn = self.moe if self.is_moe else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class Transformer(nn.Module):
    """Token embedding, blocks, final RMSNorm and LM head (optionally tied to the embedding)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg, i) for i in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn, recurse=True):
        # `to_empty` / `to` from meta replace each module's parameters one by one, which would
        # give the embedding and the head two separate tensors: tie them again.
        out = super()._apply(fn, recurse)
        if self.cfg.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight
        return out

    def forward(self, tokens: Tensor, positions: Tensor | None = None,
                document_ids: Tensor | None = None) -> Tensor:
        """tokens [B, S] -> logits [B, S, V].

        `document_ids` [B, S] (contiguous runs of equal ids) restricts attention to earlier tokens of
        the same document. `positions` [B, S] are the RoPE positions; when omitted they are the
        position inside each document if `document_ids` is given, else 0..S-1.
        """
        batch, seq = tokens.shape
        mask = None
        if document_ids is not None:
            if document_ids.shape != tokens.shape:
                raise ValueError(f"document_ids shape {tuple(document_ids.shape)} != tokens shape "
                                 f"{tuple(tokens.shape)}")
            mask = document_causal_mask(document_ids)
        if positions is None:
            if document_ids is not None:
                positions = positions_from_documents(document_ids)
            else:
                positions = torch.arange(seq, device=tokens.device).expand(batch, seq)
        elif positions.shape != tokens.shape:
            raise ValueError(f"positions shape {tuple(positions.shape)} != tokens shape {tuple(tokens.shape)}")
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, positions, mask)
        return self.output(self.norm(h))

    def moe_layers(self) -> list:
        return [layer.moe for layer in self.layers if layer.is_moe]

    def aux_loss(self) -> Tensor:
        """Σ coef · aux over MoE layers of the last forward (0 when no layer uses the aux loss)."""
        total = torch.zeros((), device=self.norm.weight.device)
        for moe in self.moe_layers():
            if moe.cfg.load_balance == "aux_loss" and moe.aux_loss is not None:
                total = total + moe.cfg.aux_loss_coef * moe.aux_loss
        return total

    @torch.no_grad()
    def update_expert_bias(self, all_reduce=None) -> None:
        """Aux-loss-free balancing step for every MoE layer (see `MoE.update_expert_bias`)."""
        for moe in self.moe_layers():
            moe.update_expert_bias(all_reduce)

    def init_weights(self, seed: int = 0, scheme: str | None = None,
                     device: torch.device | str | None = None) -> None:
        """Initialise every parameter and buffer in place with a named scheme (default cfg.init_scheme).

        A model still on the meta device is first materialised with `to_empty(device)` (CPU when
        `device` is None); plain and FSDP-sharded (DTensor) parameters are both handled.
        """
        from moetrain.model.init import init_model

        if any(t.is_meta for t in (*self.parameters(), *self.buffers())):
            self.to_empty(device=device or "cpu")
        init_model(self, scheme or self.cfg.init_scheme, seed=seed)
