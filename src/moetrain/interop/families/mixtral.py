"""Mixtral (`MixtralForCausalLM`, model_type "mixtral") as a moetrain architecture.

No QK-norm, head width `head_dim` (default hidden_size / heads), every layer MoE: softmax over all
experts, top-k (2 in the released models) renormalised to sum to 1, SwiGLU experts of
`intermediate_size`; an optional `sliding_window` that every layer uses. transformers 5 names the
MoE block `mlp` in memory, but save_pretrained writes (and from_pretrained reads) the released
checkpoints' names: `block_sparse_moe.gate` for the router and `block_sparse_moe.experts.{e}.w1`
(gate) / `w3` (up) / `w2` (down) per expert. This module declares the mapping; it reads no files
and moves no tensors.
"""

from __future__ import annotations

from typing import Any

import torch

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.data.tokenizer import Tokenizer
from moetrain.interop.adapter import Family, Refusal, plain_top_k_refusals
from moetrain.interop.config_json import decoder_config_json, decoder_fields, unsupported
from moetrain.interop.families.base import EVERY_LAYER_MOE_FIELD_NAMES, family_field_names
from moetrain.interop.layouts import decoder_names

MODEL_TYPE, ARCHITECTURE, LABEL = "mixtral", "MixtralForCausalLM", "Mixtral"

# What Mixtral and GPT-OSS (the same config.json layout, every layer MoE over num_local_experts) call alike.
LOCAL_EXPERTS_FIELD_NAMES = {
    **EVERY_LAYER_MOE_FIELD_NAMES, "moe.n_experts": "num_local_experts", "sliding_window": "sliding_window",
}
FIELD_NAMES = family_field_names(LABEL, {
    **LOCAL_EXPERTS_FIELD_NAMES, "moe.renormalize": "(top-k renormalised)",
    "layer_types": "sliding_window (every layer)",
})


def model_config(hf: dict[str, Any], where: str) -> ModelConfig:
    model, moe = decoder_fields(hf, where)
    if float(hf.get("router_jitter_noise") or 0.0):
        raise unsupported(where, "router_jitter_noise", hf["router_jitter_noise"], "moetrain's router adds no noise")
    head_dim = int(hf.get("head_dim") or model["dim"] // model["n_heads"])
    window = hf.get("sliding_window")
    moe.update(renormalize=True)  # Mixtral always renormalises its top-k (it has no norm_topk_prob)
    # Mixtral's one intermediate_size is the experts' width; ffn_hidden is unused without dense layers.
    return ModelConfig(**model, head_dim=head_dim, ffn_hidden=int(hf["intermediate_size"]), n_dense_layers=0,
                       sliding_window=int(window) if window else None,
                       moe=MoEConfig(**moe, expert_hidden=int(hf["intermediate_size"])))


def local_experts_config_json(cfg: ModelConfig, model_type: str, architecture: str, tokenizer: Tokenizer,
                              dtype: torch.dtype) -> dict[str, Any]:
    """The config.json fields Mixtral and GPT-OSS write alike: num_local_experts of intermediate_size, a free
    head_dim, no norm_topk_prob (the family fixes it)."""
    out = decoder_config_json(cfg, model_type, architecture, tokenizer, dtype)
    del out["num_experts"], out["norm_topk_prob"]
    out.update(head_dim=cfg.attention_head_dim(), intermediate_size=cfg.moe.expert_hidden,
               num_local_experts=cfg.moe.n_experts)
    return out


def config_json(cfg: ModelConfig, tokenizer: Tokenizer, dtype: torch.dtype) -> dict[str, Any]:
    out = local_experts_config_json(cfg, MODEL_TYPE, ARCHITECTURE, tokenizer, dtype)
    out.update(sliding_window=cfg.sliding_window, router_jitter_noise=0.0)
    return out


def export_refusals(cfg: ModelConfig) -> list[Refusal]:
    refusals = plain_top_k_refusals(cfg, LABEL, allow=("model.sliding_window",))
    if not cfg.moe.renormalize:
        refusals.append(Refusal("model.moe.renormalize", False, "Mixtral renormalises its top-k gates"))
    if cfg.n_dense_layers != 0:
        refusals.append(Refusal("model.n_dense_layers", cfg.n_dense_layers, "Mixtral has every layer MoE"))
    if cfg.layer_types is not None and "full_attention" in cfg.layer_types and cfg.sliding_window is not None:
        refusals.append(Refusal("model.layer_types", cfg.layer_types, "Mixtral's window covers every layer"))
    if cfg.clip_qkv is not None:
        refusals.append(Refusal("model.clip_qkv", cfg.clip_qkv, "Mixtral has no clip_qkv"))
    return refusals


def tensor_names(cfg: ModelConfig) -> dict[str, str]:
    return decoder_names(cfg, router="block_sparse_moe.gate")


def expert_names(layer: int, expert: int) -> tuple[str, str, str]:
    base = f"model.layers.{layer}.block_sparse_moe.experts.{expert}"
    return f"{base}.w1.weight", f"{base}.w3.weight", f"{base}.w2.weight"


FAMILY = Family(
    model_type=MODEL_TYPE, architecture=ARCHITECTURE, label=LABEL, field_names=FIELD_NAMES,
    export_key={"attention_kind": "gqa", "moe.score_func": "softmax", "qk_norm": "none",
                "attention_bias": "none", "attention_sinks": False}, model_config=model_config,
    config_json=config_json, export_refusals=export_refusals, tensor_names=tensor_names, expert_names=expert_names,
)
