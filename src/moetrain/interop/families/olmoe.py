"""OLMoE (`OlmoeForCausalLM`, model_type "olmoe") as a moetrain architecture.

QK-norm over the full projected width (not per head), head width hidden_size / heads, optional
`clip_qkv`, every layer MoE: softmax top-k (gates renormalised or not, `norm_topk_prob`) to SwiGLU
experts of `intermediate_size`; Llama-style tensor names, experts per expert on disk or fused as
transformers 5 holds them. This module declares the mapping; it reads no files and moves no tensors.
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
from moetrain.interop.layouts import decoder_names, fused_expert_names, per_expert_names

MODEL_TYPE, ARCHITECTURE, LABEL = "olmoe", "OlmoeForCausalLM", "OLMoE"

FIELD_NAMES = family_field_names(LABEL, {
    **EVERY_LAYER_MOE_FIELD_NAMES, "head_dim": "hidden_size / num_attention_heads",
    "qk_norm": "(QK-norm over the full width)", "clip_qkv": "clip_qkv",
})


def model_config(hf: dict[str, Any], where: str) -> ModelConfig:
    model, moe = decoder_fields(hf, where)
    dim, n_heads = model["dim"], model["n_heads"]
    if dim % n_heads:
        raise unsupported(where, "hidden_size", dim, f"OLMoE needs it divisible by num_attention_heads = {n_heads}")
    if hf.get("head_dim") not in (None, dim // n_heads):
        raise unsupported(where, "head_dim", hf.get("head_dim"), "OLMoE's head width is hidden_size / heads")
    clip = hf.get("clip_qkv")
    # OLMoE's one intermediate_size is the experts' width; ffn_hidden is unused without dense layers.
    return ModelConfig(**model, head_dim=dim // n_heads, ffn_hidden=int(hf["intermediate_size"]), n_dense_layers=0,
                       qk_norm="full", clip_qkv=float(clip) if clip is not None else None,
                       moe=MoEConfig(**moe, expert_hidden=int(hf["intermediate_size"])))


def config_json(cfg: ModelConfig, tokenizer: Tokenizer, dtype: torch.dtype) -> dict[str, Any]:
    out = decoder_config_json(cfg, MODEL_TYPE, ARCHITECTURE, tokenizer, dtype)
    out.update(intermediate_size=cfg.moe.expert_hidden, clip_qkv=cfg.clip_qkv)
    return out


def export_refusals(cfg: ModelConfig) -> list[Refusal]:
    refusals = plain_top_k_refusals(cfg, LABEL)
    if cfg.n_dense_layers != 0:
        refusals.append(Refusal("model.n_dense_layers", cfg.n_dense_layers, "OLMoE has every layer MoE"))
    if not (cfg.head_dim in (None, cfg.dim // cfg.n_heads) and cfg.dim % cfg.n_heads == 0):
        refusals.append(Refusal("model.head_dim", cfg.head_dim, "OLMoE's head width is model.dim / model.n_heads"))
    return refusals


FAMILY = Family(
    model_type=MODEL_TYPE, architecture=ARCHITECTURE, label=LABEL, field_names=FIELD_NAMES,
    export_key={"qk_norm": "full", "moe.score_func": "softmax", "attention_kind": "gqa"},
    model_config=model_config, config_json=config_json,
    export_refusals=export_refusals, tensor_names=decoder_names, expert_names=per_expert_names,
    fused_expert_names=fused_expert_names,
)
