"""Qwen2-MoE (`Qwen2MoeForCausalLM`, model_type "qwen2_moe"; Qwen1.5-MoE, Qwen2-57B-A14B) as a moetrain architecture.

Biases on q, k and v (never on o_proj), no QK-norm, head width hidden_size / heads, optional dense
first layers (`mlp_only_layers`, `decoder_sparse_step`) of `intermediate_size`; the MoE layers
route softmax top-k (renormalised or not, `norm_topk_prob`, False in the released models) to SwiGLU
experts of `moe_intermediate_size`, plus one shared SwiGLU expert of its own width
(`shared_expert_intermediate_size`) whose output is scaled per token by
sigmoid(`shared_expert_gate`(x)). Llama-style tensor names, experts per expert on disk or fused as
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
from moetrain.interop.families.base import dense_first_layers, dense_first_layers_json, family_field_names
from moetrain.interop.layouts import decoder_names, fused_expert_names, per_expert_names

MODEL_TYPE, ARCHITECTURE, LABEL = "qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2-MoE"

FIELD_NAMES = family_field_names(LABEL, {
    "head_dim": "hidden_size / num_attention_heads", "moe.n_shared_experts": "(one shared expert)",
    "attention_bias": "qkv_bias", "moe.shared_expert_hidden": "shared_expert_intermediate_size",
    "moe.shared_expert_gate": "(shared_expert_gate)",
})


def model_config(hf: dict[str, Any], where: str) -> ModelConfig:
    model, moe = decoder_fields(hf, where)
    if not hf.get("qkv_bias", True):
        raise unsupported(where, "qkv_bias", hf["qkv_bias"], "moetrain's Qwen2-MoE has its q/k/v biases")
    dim, n_heads = model["dim"], model["n_heads"]
    if dim % n_heads:
        raise unsupported(where, "hidden_size", dim, f"Qwen2-MoE needs it divisible by num_attention_heads = {n_heads}")
    dense = dense_first_layers(hf, where, model["n_layers"])
    shared = int(hf["shared_expert_intermediate_size"])
    if shared < 1:
        raise unsupported(where, "shared_expert_intermediate_size", shared, "Qwen2-MoE always has a shared expert")
    moe.update(n_shared_experts=1, shared_expert_hidden=shared, shared_expert_gate=True)
    return ModelConfig(**model, head_dim=dim // n_heads, ffn_hidden=int(hf.get("intermediate_size", 1)),
                       n_dense_layers=dense, attention_bias="qkv",
                       moe=MoEConfig(**moe, expert_hidden=int(hf["moe_intermediate_size"])))


def config_json(cfg: ModelConfig, tokenizer: Tokenizer, dtype: torch.dtype) -> dict[str, Any]:
    out = decoder_config_json(cfg, MODEL_TYPE, ARCHITECTURE, tokenizer, dtype)
    del out["attention_bias"]  # Qwen2-MoE's key is qkv_bias
    out.update(qkv_bias=True, intermediate_size=cfg.ffn_hidden, moe_intermediate_size=cfg.moe.expert_hidden,
               shared_expert_intermediate_size=cfg.moe.shared_width(), **dense_first_layers_json(cfg))
    return out


def export_refusals(cfg: ModelConfig) -> list[Refusal]:
    moe = cfg.moe
    refusals = plain_top_k_refusals(cfg, LABEL, allow=("model.moe.n_shared_experts", "model.attention_bias",
                                                       "model.moe.shared_expert_gate"))
    if not (moe.n_shared_experts == 1 and moe.shared_expert_gate):
        refusals.append(Refusal("model.moe.shared_expert_gate", moe.shared_expert_gate,
                                "Qwen2-MoE has one shared expert (model.moe.n_shared_experts = 1) with a sigmoid gate"))
    if not (cfg.head_dim in (None, cfg.dim // cfg.n_heads) and cfg.dim % cfg.n_heads == 0):
        refusals.append(Refusal("model.head_dim", cfg.head_dim, "Qwen2-MoE's head width is model.dim / model.n_heads"))
    if cfg.clip_qkv is not None:
        refusals.append(Refusal("model.clip_qkv", cfg.clip_qkv, "Qwen2-MoE has no clip_qkv"))
    return refusals


FAMILY = Family(
    model_type=MODEL_TYPE, architecture=ARCHITECTURE, label=LABEL, field_names=FIELD_NAMES,
    export_key={"attention_kind": "gqa", "moe.score_func": "softmax", "qk_norm": "none",
                "attention_bias": "qkv", "attention_sinks": False}, model_config=model_config,
    config_json=config_json, export_refusals=export_refusals, tensor_names=decoder_names,
    expert_names=per_expert_names, fused_expert_names=fused_expert_names,
)
