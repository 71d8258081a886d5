"""Qwen3-MoE (`Qwen3MoeForCausalLM`, model_type "qwen3_moe") as a moetrain architecture.

QK-norm per head, a free head_dim, optional dense first layers (`mlp_only_layers`, or a
`decoder_sparse_step` that makes every k-th layer MoE) with their own `intermediate_size`; the MoE
layers route softmax top-k (gates renormalised or not, `norm_topk_prob`) to SwiGLU experts of
`moe_intermediate_size`; Llama-style tensor names, experts per expert on disk or fused as
transformers 5 holds them. This module declares the mapping; it reads no files and moves no tensors.
"""

from __future__ import annotations

from typing import Any

import torch

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.data.tokenizer import Tokenizer
from moetrain.interop.adapter import Family, Refusal, plain_top_k_refusals
from moetrain.interop.config_json import decoder_config_json, decoder_fields
from moetrain.interop.families.base import dense_first_layers, dense_first_layers_json, family_field_names
from moetrain.interop.layouts import decoder_names, fused_expert_names, per_expert_names

MODEL_TYPE, ARCHITECTURE, LABEL = "qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3-MoE"

FIELD_NAMES = family_field_names(LABEL, {"qk_norm": "(QK-norm per head)"})


def model_config(hf: dict[str, Any], where: str) -> ModelConfig:
    model, moe = decoder_fields(hf, where)
    head_dim = int(hf.get("head_dim") or model["dim"] // model["n_heads"])
    return ModelConfig(**model, head_dim=head_dim, ffn_hidden=int(hf.get("intermediate_size", 1)),
                       n_dense_layers=dense_first_layers(hf, where, model["n_layers"]), qk_norm="per_head",
                       moe=MoEConfig(**moe, expert_hidden=int(hf["moe_intermediate_size"])))


def config_json(cfg: ModelConfig, tokenizer: Tokenizer, dtype: torch.dtype) -> dict[str, Any]:
    out = decoder_config_json(cfg, MODEL_TYPE, ARCHITECTURE, tokenizer, dtype)
    out.update(head_dim=cfg.attention_head_dim(), intermediate_size=cfg.ffn_hidden,
               moe_intermediate_size=cfg.moe.expert_hidden, **dense_first_layers_json(cfg))
    return out


def export_refusals(cfg: ModelConfig) -> list[Refusal]:
    refusals = plain_top_k_refusals(cfg, LABEL)
    if cfg.clip_qkv is not None:
        refusals.append(Refusal("model.clip_qkv", cfg.clip_qkv, "Qwen3-MoE has no clip_qkv"))
    return refusals


FAMILY = Family(
    model_type=MODEL_TYPE, architecture=ARCHITECTURE, label=LABEL, field_names=FIELD_NAMES,
    export_key={"qk_norm": "per_head", "moe.score_func": "softmax", "attention_kind": "gqa"},
    model_config=model_config, config_json=config_json,
    export_refusals=export_refusals, tensor_names=decoder_names, expert_names=per_expert_names,
    fused_expert_names=fused_expert_names,
)
