"""GLM-4.5 (`Glm4MoeForCausalLM`, model_type "glm4_moe") as a moetrain architecture.

Grouped-query attention with a free head_dim, q/k/v biases (`attention_bias`; never an o_proj
bias), optional per-head QK-norm (`use_qk_norm`) and partial rotary RoPE (`partial_rotary_factor`,
in `rope_parameters`, 0.5 when absent as transformers defaults it: the first half of each head's
channels rotate, in the "half" layout); the first `first_k_dense_replace` layers dense, the rest
routed as DeepSeek-V3 (sigmoid, group-limited top-k on scores + the correction bias, which is
moetrain's `expert_bias`, renormalised gates times `routed_scaling_factor`, shared experts).
Multi-token-prediction modules are stored and mapped as DeepSeek-V3's (their block: GLM-4.5's
attention). This module declares the mapping; it reads no files and moves no tensors.
"""

from __future__ import annotations

from typing import Any

import torch

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.data.tokenizer import Tokenizer
from moetrain.interop.adapter import Family, Refusal
from moetrain.interop.config_json import decoder_config_json, decoder_fields, rope_fields, unsupported
from moetrain.interop.families.base import family_field_names
from moetrain.interop.families.deepseek_v3 import (
    FLOAT32_NAMES,
    OWN_FIELD_NAMES,
    as_mtp_block,
    correction_bias_refusals,
    moe_config_json,
    moe_layer_names,
    mtp_shared_copies,
    sigmoid_moe_fields,
    sigmoid_routing_refusals,
    skipped_tensors,
)
from moetrain.interop.layouts import attention_names, embedding_names, fused_expert_names, per_expert_names

MODEL_TYPE, ARCHITECTURE, LABEL = "glm4_moe", "Glm4MoeForCausalLM", "GLM-4.5"

FIELD_NAMES = family_field_names(LABEL, {
    **OWN_FIELD_NAMES, "n_kv_heads": "num_key_value_heads", "head_dim": "head_dim", "attention_bias": "attention_bias",
    "qk_norm": "use_qk_norm", "partial_rotary_factor": "rope_parameters.partial_rotary_factor",
    "rope_layout": "(the half layout)", "kv_lora_rank": "(no MLA)",
})
DEFAULT_PARTIAL_ROTARY = 0.5  # transformers' Glm4MoeConfig default when config.json has none


def model_config(hf: dict[str, Any], where: str) -> ModelConfig:
    if "n_routed_experts" not in hf:
        raise unsupported(where, "n_routed_experts", None, "GLM-4.5 config.json needs it")
    model, moe = decoder_fields({**hf, "num_experts": hf["n_routed_experts"], "attention_bias": False,
                                 "rope_scaling": None, "rope_parameters": {"rope_type": "default"}}, where)
    model.update(rope_fields(hf, where))
    params = hf.get("rope_parameters") or {}
    partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY)))
    dense, moe = sigmoid_moe_fields(hf, where, model, moe)
    head_dim = int(hf.get("head_dim") or model["dim"] // model["n_heads"])
    return ModelConfig(**model, head_dim=head_dim, n_dense_layers=dense, ffn_hidden=int(hf.get("intermediate_size", 1)),
                       qk_norm="per_head" if hf.get("use_qk_norm", False) else "none",
                       attention_bias="qkv" if hf.get("attention_bias", False) else "none",
                       partial_rotary_factor=partial,
                       moe=MoEConfig(**moe))


def config_json(cfg: ModelConfig, tokenizer: Tokenizer, dtype: torch.dtype) -> dict[str, Any]:
    out = decoder_config_json(cfg, MODEL_TYPE, ARCHITECTURE, tokenizer, dtype)
    del out["num_experts"]
    out.update(moe_config_json(cfg))
    out["rope_parameters"]["partial_rotary_factor"] = cfg.partial_rotary_factor
    out.update(head_dim=cfg.attention_head_dim(), use_qk_norm=cfg.qk_norm == "per_head",
               attention_bias=cfg.attention_bias == "qkv")
    return out


def export_refusals(cfg: ModelConfig) -> list[Refusal]:
    refusals = sigmoid_routing_refusals(cfg, LABEL)
    if cfg.qk_norm == "full":
        refusals.append(Refusal("model.qk_norm", cfg.qk_norm, "GLM-4.5's QK-norm is per head"))
    return refusals


def tensor_names(cfg: ModelConfig) -> dict[str, str]:
    names = embedding_names(cfg)
    for i in range(cfg.n_layers + cfg.mtp_depth):
        names.update(as_mtp_block(cfg, i, {**attention_names(cfg, i), **moe_layer_names(cfg, i)}))
    return names


FAMILY = Family(
    model_type=MODEL_TYPE, architecture=ARCHITECTURE, label=LABEL, field_names=FIELD_NAMES,
    export_key={"attention_kind": "gqa", "moe.score_func": "sigmoid"}, model_config=model_config,
    config_json=config_json, export_refusals=export_refusals, tensor_names=tensor_names,
    expert_names=per_expert_names, fused_expert_names=fused_expert_names, skipped_tensors=skipped_tensors,
    float32_names=FLOAT32_NAMES, import_refusals=correction_bias_refusals, shared_copies=mtp_shared_copies,
)
