"""Parameter counts and training FLOPs per token of a `Transformer(cfg)`, from the config alone.

Used for MFU: FLOPs per token = 6 · (matmul parameters a token passes through) + 12 · L · H · D_h · S,
the PaLM (arXiv 2204.02311, App. B) / nanoGPT convention: 2 FLOPs per multiply-add, ×3 for forward
plus backward, and the attention score/value products counted over the full S×S matrix (the causal
half is not discounted). MoE layers count only the top_k routed experts a token visits, plus the
router and shared experts. Embedding lookups and norms are not matmuls; the LM head is.
No tensors are built here.
"""

from __future__ import annotations

from moetrain.config import ModelConfig


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Keys: total, embedding (token embedding), active (parameters one token uses, embedding row
    and norms included), active_matmul (the matmul part of `active`, what FLOPs are counted on),
    routed_experts (all routed expert weights)."""
    d, heads, kv_heads = cfg.dim, cfg.n_heads, cfg.n_kv_heads or cfg.n_heads
    head_dim = cfg.attention_head_dim()
    moe = cfg.moe
    attention = d * heads * head_dim * 2 + d * kv_heads * head_dim * 2  # wq, wo, wk, wv
    qk_norm = {"none": 0, "per_head": 2 * head_dim, "full": (heads + kv_heads) * head_dim}[cfg.qk_norm]
    # Projection biases and sinks are not matmul parameters: counted with the norms (in `active`, not FLOPs).
    attention_bias = {"none": 0, "qkv": (heads + 2 * kv_heads) * head_dim,
                      "all": (heads + 2 * kv_heads) * head_dim + d}[cfg.attention_bias]
    norms_per_layer = 2 * d + qk_norm + attention_bias + (heads if cfg.attention_sinks else 0)
    dense_ffn = 3 * d * cfg.ffn_hidden
    w1_width = moe.expert_hidden if moe.activation == "gelu" else 2 * moe.expert_hidden
    one_expert = d * w1_width + moe.expert_hidden * d
    one_expert_bias = (w1_width + d) if moe.expert_proj_bias else 0
    router = d * moe.n_experts
    router_bias = moe.n_experts if moe.router_bias else 0
    shared = 3 * d * moe.shared_width() + (d if moe.shared_expert_gate else 0)
    n_moe = cfg.n_layers - cfg.n_dense_layers
    n_dense = cfg.n_dense_layers
    embedding = cfg.vocab_size * d
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    head_matmul = cfg.vocab_size * d  # tied or not, the head is a matmul
    layer_matmul_dense = attention + dense_ffn
    layer_matmul_moe_active = attention + router + shared + moe.top_k * one_expert
    moe_biases = router_bias + moe.n_experts * one_expert_bias
    total = (embedding + head + d
             + n_dense * (layer_matmul_dense + norms_per_layer)
             + n_moe * (attention + router + shared + moe.n_experts * one_expert + norms_per_layer + moe_biases))
    active_matmul = head_matmul + n_dense * layer_matmul_dense + n_moe * layer_matmul_moe_active
    # + norms (and biases, sinks), + the token's embedding row (already inside the head matrix when tied)
    active = (active_matmul + cfg.n_layers * norms_per_layer + n_moe * (router_bias + moe.top_k * one_expert_bias)
              + d + (0 if cfg.tie_embeddings else d))
    return {
        "total": total,
        "embedding": embedding,
        "active": active,
        "active_matmul": active_matmul,
        "routed_experts": n_moe * moe.n_experts * one_expert,
    }


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token of the QKᵀ and AV products: 3 · 2 · 2 · L · H · D_h · S."""
    head_dim = cfg.attention_head_dim()
    return 12.0 * cfg.n_layers * cfg.n_heads * head_dim * seq_len


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token: 6 · active matmul params + attention term."""
    return 6.0 * count_params(cfg)["active_matmul"] + attention_flops_per_token(cfg, seq_len)
