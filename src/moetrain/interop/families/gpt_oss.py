"""GPT-OSS (`GptOssForCausalLM`, model_type "gpt_oss"; gpt-oss-20b, gpt-oss-120b) as a moetrain architecture.

A free `head_dim`, no QK-norm, biases on q, k, v and o (`attention_bias`), a learned sink logit per
query head, sliding-window attention (`sliding_window`) on the layers `layer_types` marks
"sliding_attention" (every other layer by default), every layer MoE. The router is a biased linear
layer whose top-k logits go through a softmax (moetrain's softmax router with renormalised top-k
computes the same, see model/moe.py); the experts have biases and the clamped SwiGLU
(`swiglu_alpha`, `swiglu_limit`). The experts are stored as transformers holds them, on disk as in
memory: gate_up_proj [E, d, 2n] with gate and up interleaved, down_proj [E, n, d], and their biases
(the adapter's interleaved layout). RoPE is the default or YaRN (the released models' and
transformers' default for GPT-OSS), read and written as `rope_parameters`. This module declares the
mapping; it reads no files and moves no tensors.
"""

from __future__ import annotations

from typing import Any

import torch

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.data.tokenizer import Tokenizer
from moetrain.interop.adapter import Family, Refusal, plain_top_k_refusals
from moetrain.interop.config_json import decoder_fields, rope_fields, rope_parameters, unsupported
from moetrain.interop.families.base import YARN_FIELD_NAMES, family_field_names
from moetrain.interop.families.mixtral import LOCAL_EXPERTS_FIELD_NAMES, local_experts_config_json
from moetrain.interop.layouts import decoder_names, interleaved_expert_names

MODEL_TYPE, ARCHITECTURE, LABEL = "gpt_oss", "GptOssForCausalLM", "GPT-OSS"
LAYER_TYPES = ("full_attention", "sliding_attention")

FIELD_NAMES = family_field_names(LABEL, {
    **LOCAL_EXPERTS_FIELD_NAMES, "moe.score_func": "(softmax over the top-k logits)",
    "moe.renormalize": "(softmax over the top-k logits)", "moe.activation": "(clamped SwiGLU)",
    "attention_bias": "attention_bias", "attention_sinks": "(attention sinks)", "layer_types": "layer_types",
    "moe.router_bias": "(router bias)", "moe.expert_proj_bias": "(expert biases)",
    "moe.swiglu_alpha": "swiglu_alpha", "moe.swiglu_limit": "swiglu_limit", **YARN_FIELD_NAMES,
})


def model_config(hf: dict[str, Any], where: str) -> ModelConfig:
    model, moe = decoder_fields({**hf, "rope_scaling": None, "rope_parameters": {"rope_type": "default"}}, where,
                                allow=("attention_bias",))
    model.update(rope_fields(hf, where))
    n_layers = model["n_layers"]
    layer_types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                            for i in range(n_layers)]
    if len(layer_types) != n_layers or any(t not in LAYER_TYPES for t in layer_types):
        raise unsupported(where, "layer_types", layer_types, f"one of {LAYER_TYPES} per layer")
    window = hf.get("sliding_window")
    if "sliding_attention" in layer_types and not window:
        raise unsupported(where, "sliding_window", window, "sliding_attention layers need a window")
    head_dim = int(hf.get("head_dim") or model["dim"] // model["n_heads"])
    moe.update(renormalize=True, activation="clamped_swiglu", router_bias=True, expert_proj_bias=True,
               swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)), swiglu_limit=float(hf.get("swiglu_limit", 7.0)))
    return ModelConfig(**model, head_dim=head_dim, ffn_hidden=int(hf["intermediate_size"]), n_dense_layers=0,
                       attention_bias="all" if hf.get("attention_bias", True) else "none", attention_sinks=True,
                       sliding_window=int(window) if "sliding_attention" in layer_types else None,
                       layer_types=list(layer_types) if "sliding_attention" in layer_types else None,
                       moe=MoEConfig(**moe, expert_hidden=int(hf["intermediate_size"])))


def config_json(cfg: ModelConfig, tokenizer: Tokenizer, dtype: torch.dtype) -> dict[str, Any]:
    out = local_experts_config_json(cfg, MODEL_TYPE, ARCHITECTURE, tokenizer, dtype)
    layer_types = ["full_attention" if cfg.window_of(i) is None else "sliding_attention" for i in range(cfg.n_layers)]
    out.update(attention_bias=cfg.attention_bias == "all", layer_types=layer_types, sliding_window=cfg.sliding_window,
               swiglu_alpha=cfg.moe.swiglu_alpha, swiglu_limit=cfg.moe.swiglu_limit,
               rope_parameters=rope_parameters(cfg))
    return out


def export_refusals(cfg: ModelConfig) -> list[Refusal]:
    moe = cfg.moe
    refusals = plain_top_k_refusals(cfg, LABEL, allow=("model.rope_scaling", "model.moe.activation",
                                                       "model.attention_bias",
                                                       "model.attention_sinks", "model.sliding_window",
                                                       "model.moe.router_bias", "model.moe.expert_proj_bias"))
    for ok, name, value, why in (
        (moe.activation == "clamped_swiglu", "model.moe.activation", moe.activation, "GPT-OSS's experts use the "
         "clamped SwiGLU"),
        (cfg.attention_bias != "qkv", "model.attention_bias", cfg.attention_bias, "GPT-OSS biases q, k, v and o "
         "alike"),
        (moe.renormalize, "model.moe.renormalize", moe.renormalize, "GPT-OSS's softmax covers the top-k logits only"),
        (moe.router_bias, "model.moe.router_bias", moe.router_bias, "GPT-OSS's router has a bias"),
        (moe.expert_proj_bias, "model.moe.expert_proj_bias", moe.expert_proj_bias, "GPT-OSS's experts have biases"),
        (cfg.n_dense_layers == 0, "model.n_dense_layers", cfg.n_dense_layers, "GPT-OSS has every layer MoE"),
        (cfg.clip_qkv is None, "model.clip_qkv", cfg.clip_qkv, "GPT-OSS has no clip_qkv"),
    ):
        if not ok:
            refusals.append(Refusal(name, value, why))
    return refusals


def tensor_names(cfg: ModelConfig) -> dict[str, str]:
    return decoder_names(cfg, router="mlp.router")


FAMILY = Family(
    model_type=MODEL_TYPE, architecture=ARCHITECTURE, label=LABEL, field_names=FIELD_NAMES,
    export_key={"attention_kind": "gqa", "moe.score_func": "softmax", "qk_norm": "none",
                "attention_sinks": True}, model_config=model_config, config_json=config_json,
    export_refusals=export_refusals, tensor_names=tensor_names, expert_names=None,
    interleaved_expert_names=interleaved_expert_names,
)
