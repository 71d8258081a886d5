"""Parameter counts and training FLOPs per token of a `Transformer(cfg)`, from the config alone.

Used for MFU: FLOPs per token = 6 · (matmul parameters a token passes through) + 12 · L · H · D_h · S,
the PaLM (arXiv 2204.02311, App. B) / nanoGPT convention: 2 FLOPs per multiply-add, ×3 for forward
plus backward, and the attention score/value products counted over the full S×S matrix (the causal
half is not discounted). MoE layers count only the top_k routed experts a token visits, plus the
router and shared experts. Embedding lookups and norms are not matmuls; the LM head is.
No tensors are built here.
"""

from __future__ import annotations

from moetrain.config.model import ModelConfig


def count_params(cfg: ModelConfig) -> dict[str, int]:
    """Keys: total, embedding (token embedding), active (parameters one token uses, embedding row
    and norms included), active_matmul (the matmul part of `active`, what FLOPs are counted on),
    routed_experts (all routed expert weights)."""
    d = cfg.dim
    moe = cfg.moe
    attention, attention_vectors = _attention_params(cfg)
    norms_per_layer = 2 * d + attention_vectors  # every per-layer parameter outside a matmul
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


def _attention_params(cfg: ModelConfig) -> tuple[int, int]:
    """(matmul parameters, other parameters: QK-norm / latent norm weights and biases) of one attention layer."""
    d, heads = cfg.dim, cfg.n_heads
    if cfg.kv_lora_rank is not None:  # multi-head latent attention (model/mla.py)
        qk_head = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        if cfg.q_lora_rank is None:
            query, query_norm = d * heads * qk_head, 0
        else:
            query, query_norm = d * cfg.q_lora_rank + cfg.q_lora_rank * heads * qk_head, cfg.q_lora_rank
        kv = d * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim
                                                                                           + cfg.v_head_dim)
        return query + kv + heads * cfg.v_head_dim * d, query_norm + cfg.kv_lora_rank
    kv_heads, head_dim = cfg.n_kv_heads or heads, cfg.attention_head_dim()
    matmul = d * heads * head_dim * 2 + d * kv_heads * head_dim * 2  # wq, wo, wk, wv
    qk_norm = {"none": 0, "per_head": 2 * head_dim, "full": (heads + kv_heads) * head_dim}[cfg.qk_norm]
    # Projection biases and sinks are not matmul parameters: counted with the norms (in `active`, not FLOPs).
    bias = {"none": 0, "qkv": (heads + 2 * kv_heads) * head_dim,
            "all": (heads + 2 * kv_heads) * head_dim + d}[cfg.attention_bias]
    return matmul, qk_norm + bias + (heads if cfg.attention_sinks else 0)


def attention_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token of the QKᵀ and AV products: 3 · 2 · L · H · (D_qk + D_v) · S
    (= 12 · L · H · D_h · S when queries and values are D_h wide; MLA's are qk_nope + qk_rope and v_head_dim)."""
    if cfg.kv_lora_rank is not None:
        widths = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim
    else:
        widths = 2 * cfg.attention_head_dim()
    return 6.0 * cfg.n_layers * cfg.n_heads * widths * seq_len


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token: 6 · active matmul params + attention term."""
    return 6.0 * count_params(cfg)["active_matmul"] + attention_flops_per_token(cfg, seq_len)
