"""Hugging Face tensor names of the Llama-style MoE decoder (`model.layers.{i}.self_attn.q_proj`, `mlp.experts`).

Several families store their tensors under these names; a family whose names differ writes its own
in its module. This module only builds names: it knows no family, reads no files and moves no
tensors.
"""

from __future__ import annotations

from moetrain.config.model import ModelConfig


def decoder_names(cfg: ModelConfig, router: str = "mlp.gate") -> dict[str, str]:
    """moetrain parameter name -> Hugging Face name, for every parameter that is not a routed expert.

    Covers what the config has of: attention projection biases, attention sinks (`self_attn.sinks`),
    a router bias, a shared expert (`mlp.shared_expert.*`) and its gate (`mlp.shared_expert_gate`).
    `router` is the router's module path inside a layer (GPT-OSS: "mlp.router").
    """
    names = embedding_names(cfg)
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}", f"model.layers.{i}"
        names.update(attention_names(cfg, i))
        names[f"{ours}.attention_norm.weight"] = f"{theirs}.input_layernorm.weight"
        names[f"{ours}.ffn_norm.weight"] = f"{theirs}.post_attention_layernorm.weight"
        if i < cfg.n_dense_layers:
            for a, b in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                names[f"{ours}.feed_forward.{a}.weight"] = f"{theirs}.mlp.{b}.weight"
        else:
            names[f"{ours}.moe.router.weight"] = f"{theirs}.{router}.weight"
            if cfg.moe.router_bias:
                names[f"{ours}.moe.router.bias"] = f"{theirs}.{router}.bias"
            if cfg.moe.n_shared_experts:
                for a, b in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                    names[f"{ours}.moe.shared_expert.{a}.weight"] = f"{theirs}.mlp.shared_expert.{b}.weight"
            if cfg.moe.shared_expert_gate:
                names[f"{ours}.moe.shared_expert_gate.weight"] = f"{theirs}.mlp.shared_expert_gate.weight"
    return names


def embedding_names(cfg: ModelConfig) -> dict[str, str]:
    """The token embeddings, the final norm and (untied) the output head."""
    names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        names["output.weight"] = "lm_head.weight"
    return names


def attention_names(cfg: ModelConfig, i: int) -> dict[str, str]:
    """Grouped-query attention of layer i: q/k/v/o projections, the biases, sinks and QK-norm the config has."""
    ours, theirs = f"layers.{i}.attention", f"model.layers.{i}.self_attn"
    names = {}
    for a, b in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
        names[f"{ours}.{a}.weight"] = f"{theirs}.{b}.weight"
        if cfg.attention_bias == "all" or (cfg.attention_bias == "qkv" and a != "wo"):
            names[f"{ours}.{a}.bias"] = f"{theirs}.{b}.bias"
    if cfg.attention_sinks:
        names[f"{ours}.sinks"] = f"{theirs}.sinks"
    if cfg.qk_norm != "none":
        names[f"{ours}.q_norm.weight"] = f"{theirs}.q_norm.weight"
        names[f"{ours}.k_norm.weight"] = f"{theirs}.k_norm.weight"
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


def interleaved_expert_names(layer: int) -> tuple[str, str, str, str]:
    """GPT-OSS's expert tensors, on disk as in memory: gate_up_proj [E, d, 2n] (gate and up interleaved),
    gate_up_proj_bias [E, 2n], down_proj [E, n, d], down_proj_bias [E, d]."""
    base = f"model.layers.{layer}.mlp.experts"
    return f"{base}.gate_up_proj", f"{base}.gate_up_proj_bias", f"{base}.down_proj", f"{base}.down_proj_bias"
