"""Hugging Face tensor names of the Llama-style MoE decoder (`model.layers.{i}.self_attn.q_proj`, `mlp.experts`).

Several families store their tensors under these names; a family whose names differ writes its own
in its module. This module only builds names: it knows no family, reads no files and moves no
tensors.
"""

from __future__ import annotations

from moetrain.config import ModelConfig


def decoder_names(cfg: ModelConfig) -> dict[str, str]:
    """moetrain parameter name -> Hugging Face name, for every parameter that is not a routed expert."""
    names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        names["output.weight"] = "lm_head.weight"
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}", f"model.layers.{i}"
        for a, b in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
            names[f"{ours}.attention.{a}.weight"] = f"{theirs}.self_attn.{b}.weight"
        if cfg.qk_norm != "none":
            names[f"{ours}.attention.q_norm.weight"] = f"{theirs}.self_attn.q_norm.weight"
            names[f"{ours}.attention.k_norm.weight"] = f"{theirs}.self_attn.k_norm.weight"
        names[f"{ours}.attention_norm.weight"] = f"{theirs}.input_layernorm.weight"
        names[f"{ours}.ffn_norm.weight"] = f"{theirs}.post_attention_layernorm.weight"
        if i < cfg.n_dense_layers:
            for a, b in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                names[f"{ours}.feed_forward.{a}.weight"] = f"{theirs}.mlp.{b}.weight"
        else:
            names[f"{ours}.moe.router.weight"] = f"{theirs}.mlp.gate.weight"
    return names


def per_expert_names(layer: int, expert: int) -> tuple[str, str, str]:
    """Per-expert names (gate_proj [n, d], up_proj [n, d], down_proj [d, n]), as save_pretrained writes."""
    base = f"model.layers.{layer}.mlp.experts.{expert}"
    return f"{base}.gate_proj.weight", f"{base}.up_proj.weight", f"{base}.down_proj.weight"


def fused_expert_names(layer: int) -> tuple[str, str]:
    """transformers 5's in-memory expert names, which from_pretrained also reads from disk: gate_up_proj
    [E, 2n, d] and down_proj [E, d, n]."""
    base = f"model.layers.{layer}.mlp.experts"
    return f"{base}.gate_up_proj", f"{base}.down_proj"
