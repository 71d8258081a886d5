"""What the families share: the Llama-style config.json name of every architecture field, and its readings.

`LLAMA_FIELD_NAMES` is the one list of the architecture fields a Hugging Face directory fixes
(`ARCH_FIELDS` is its key order): a new ModelConfig field is added here, and then only in the families
that map it. A family lists only where it differs (`family_field_names`); a field the Llama-style
decoder lacks and a family does not map reads "(not in LABEL)" in its messages. Also here: the
dense-first-layer reading of `mlp_only_layers` / `decoder_sparse_step`. This module declares names
and pure readings; it knows no family by name, reads no files and moves no tensors.
"""

from __future__ import annotations

from typing import Any

from moetrain.config.model import ModelConfig
from moetrain.interop.config_json import unsupported

# moetrain architecture field -> what fixes it in a Llama-style MoE config.json (Qwen3-MoE's names), or
# the wording for an option such a decoder does not have; None: "(not in LABEL)" in the family's messages.
LLAMA_FIELD_NAMES: dict[str, str | None] = {
    "vocab_size": "vocab_size", "dim": "hidden_size", "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
    "n_dense_layers": "mlp_only_layers", "ffn_hidden": "intermediate_size", "rope_theta": "rope_theta",
    "qk_norm": "(no QK-norm)", "clip_qkv": "(no clip_qkv)", "norm_eps": "rms_norm_eps",
    "tie_embeddings": "tie_word_embeddings", "moe.n_experts": "num_experts", "moe.top_k": "num_experts_per_tok",
    "moe.expert_hidden": "moe_intermediate_size", "moe.n_shared_experts": "(no shared expert)",
    "moe.score_func": "(softmax router)", "moe.renormalize": "norm_topk_prob", "moe.activation": "hidden_act",
    "attention_bias": "(no attention bias)", "attention_sinks": "(no attention sinks)",
    "sliding_window": "(no sliding window)", "layer_types": "(every layer full attention)",
    "moe.router_bias": "(no router bias)", "moe.expert_proj_bias": "(no expert biases)",
    "moe.shared_expert_hidden": "(no shared expert)", "moe.shared_expert_gate": "(no shared expert gate)",
    "moe.swiglu_alpha": "(plain SwiGLU)", "moe.swiglu_limit": "(plain SwiGLU)",
    # Multi-head latent attention, partial rotary, YaRN and group-limited routing.
    "moe.n_group": None, "moe.topk_group": None, "moe.routed_scaling_factor": None, "partial_rotary_factor": None,
    "kv_lora_rank": None, "q_lora_rank": None, "qk_nope_head_dim": None, "qk_rope_head_dim": None,
    "v_head_dim": None, "rope_layout": None, "rope_scaling": None, "rope_yarn_factor": None,
    "rope_yarn_original_max_seq_len": None, "rope_yarn_beta_fast": None, "rope_yarn_beta_slow": None,
    "rope_yarn_mscale": None, "rope_yarn_mscale_all_dim": None, "rope_yarn_truncate": None,
}
# The architecture fields a Hugging Face directory fixes (each family names what sets them in config.json).
ARCH_FIELDS = tuple(LLAMA_FIELD_NAMES)

# A family with every layer MoE: its one intermediate_size is the experts' width.
EVERY_LAYER_MOE_FIELD_NAMES = {
    "n_dense_layers": "(every layer MoE)", "ffn_hidden": "(no dense layer)", "moe.expert_hidden": "intermediate_size",
}
# Where config.json keeps the YaRN fields (transformers 5's `rope_parameters`).
YARN_FIELD_NAMES = {
    "rope_scaling": "rope_parameters.rope_type", "rope_yarn_factor": "rope_parameters.factor",
    "rope_yarn_original_max_seq_len": "rope_parameters.original_max_position_embeddings",
    "rope_yarn_beta_fast": "rope_parameters.beta_fast", "rope_yarn_beta_slow": "rope_parameters.beta_slow",
    "rope_yarn_mscale": "rope_parameters.mscale", "rope_yarn_mscale_all_dim": "rope_parameters.mscale_all_dim",
    "rope_yarn_truncate": "rope_parameters.truncate",
}


def family_field_names(label: str, own: dict[str, str]) -> dict[str, str]:
    """A family's `field_names`, every ARCH_FIELDS entry: `own` where the family differs from LLAMA_FIELD_NAMES."""
    unknown = sorted(set(own) - set(LLAMA_FIELD_NAMES))
    if unknown:
        raise ValueError(f"{label} names fields that are not architecture fields: {unknown}")
    return {name: own.get(name) or llama or f"(not in {label})" for name, llama in LLAMA_FIELD_NAMES.items()}


def dense_first_layers(hf: dict[str, Any], where: str, n_layers: int) -> int:
    """How many dense layers `mlp_only_layers` and `decoder_sparse_step` (every k-th layer MoE) make; they
    must be the first ones, else one ConfigError line."""
    step = int(hf.get("decoder_sparse_step", 1))
    mlp_only = set(hf.get("mlp_only_layers") or [])
    dense = [i for i in range(n_layers) if i in mlp_only or (i + 1) % step != 0]
    if dense != list(range(len(dense))):
        raise unsupported(where, "mlp_only_layers / decoder_sparse_step", (sorted(mlp_only), step),
                          "moetrain's dense layers must be the first ones (layers 0..k-1)")
    return len(dense)


def dense_first_layers_json(cfg: ModelConfig) -> dict[str, Any]:
    """The dense-first-layer fields written back (every layer past them MoE), and the sliding window the
    same config classes carry, off."""
    return {"decoder_sparse_step": 1, "mlp_only_layers": list(range(cfg.n_dense_layers)),
            "use_sliding_window": False, "sliding_window": None}
