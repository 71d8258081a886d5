"""DeepSeek-V3 (`DeepseekV3ForCausalLM`, model_type "deepseek_v3") as a moetrain architecture.

The architecture of DeepSeek-V3/R1, Kimi-K2 and Moonlight: multi-head latent attention
(`model.mla`; `q_lora_rank` set or absent, `rope_interleave` is moetrain's RoPE layout, YaRN
RoPE), the first `first_k_dense_replace` layers dense, the rest MoE with sigmoid scores,
group-limited top-k (`n_group`, `topk_group`) on scores + `e_score_correction_bias` (moetrain's
aux-free `expert_bias` buffer, which travels in both directions), renormalised gates times
`routed_scaling_factor`, and `n_shared_experts` shared experts. Multi-token-prediction modules
(`num_nextn_predict_layers`, moetrain's `model.mtp_depth`) are stored as layers past
num_hidden_layers: module k is `model.layers.{num_hidden_layers + k - 1}` with `enorm`, `hnorm`,
`eh_proj`, `shared_head.norm`, one decoder layer's tensors (MoE), and copies of the embedding and
output head (`embed_tokens`, `shared_head.head`) that moetrain shares with the main model
(`mtp_shared_copies`). A job with a smaller model.mtp_depth skips the deeper modules' tensors with
one warning line. This module declares the mapping; it reads no files and moves no tensors.
"""

from __future__ import annotations

from typing import Any

import torch

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.data.tokenizer import Tokenizer
from moetrain.interop.adapter import Family, Refusal, gpt_oss_era_checks
from moetrain.interop.config_json import (
    decoder_config_json,
    decoder_fields,
    integer,
    rope_fields,
    rope_parameters,
    unsupported,
)
from moetrain.interop.families.base import YARN_FIELD_NAMES, family_field_names
from moetrain.interop.layouts import embedding_names, fused_expert_names, per_expert_names

MODEL_TYPE, ARCHITECTURE, LABEL = "deepseek_v3", "DeepseekV3ForCausalLM", "DeepSeek-V3"

# Where DeepSeek-V3 differs from the Llama-style names (GLM-4.5 starts from these too).
OWN_FIELD_NAMES = {
    "n_kv_heads": "(num_key_value_heads = num_attention_heads)",
    "head_dim": "(MLA: qk_nope_head_dim + qk_rope_head_dim)",
    "n_dense_layers": "first_k_dense_replace", "moe.n_experts": "n_routed_experts",
    "moe.n_shared_experts": "n_shared_experts", "moe.score_func": "(sigmoid router)",
    "moe.n_group": "n_group", "moe.topk_group": "topk_group", "moe.routed_scaling_factor": "routed_scaling_factor",
    "kv_lora_rank": "kv_lora_rank", "q_lora_rank": "q_lora_rank", "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim", "rope_layout": "rope_interleave",
    "partial_rotary_factor": "(every rope channel rotates)", **YARN_FIELD_NAMES,
}
FIELD_NAMES = family_field_names(LABEL, OWN_FIELD_NAMES)

# transformers keeps the router and the correction bias in float32 (`_keep_in_fp32_modules_strict`).
FLOAT32_NAMES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")


def sigmoid_moe_fields(hf: dict[str, Any], where: str, model: dict[str, Any],
                       moe: dict[str, Any]) -> tuple[int, dict]:
    """(dense layers, MoEConfig fields) of DeepSeek-V3-style routing, shared by GLM-4.5; model["mtp_depth"] set."""
    model["mtp_depth"] = int(hf.get("num_nextn_predict_layers") or 0)
    if model["mtp_depth"] < 0:
        raise unsupported(where, "num_nextn_predict_layers", model["mtp_depth"], "must be >= 0")
    dense = int(hf.get("first_k_dense_replace") or 0)
    if not 0 <= dense <= model["n_layers"]:
        raise unsupported(where, "first_k_dense_replace", dense,
                          f"must be in [0, num_hidden_layers = {model['n_layers']}]")
    if hf.get("topk_method", "noaux_tc") != "noaux_tc" or hf.get("scoring_func", "sigmoid") != "sigmoid":
        key = "topk_method" if hf.get("topk_method", "noaux_tc") != "noaux_tc" else "scoring_func"
        raise unsupported(where, key, hf.get(key), "moetrain routes as DeepSeek-V3: sigmoid scores, noaux_tc")
    moe.update(score_func="sigmoid", n_shared_experts=int(hf.get("n_shared_experts") or 0),
               expert_hidden=int(hf["moe_intermediate_size"]),
               # an integer or null (one group), never truncated: n_group = 2.5 is refused, not read as 2
               n_group=integer({"n_group": hf.get("n_group") or 1}, "n_group", where),
               topk_group=integer({"topk_group": hf.get("topk_group") or 1}, "topk_group", where),
               routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
               # The correction bias chooses experts only under aux-free balancing, which also keeps it updated.
               load_balance="aux_free", renormalize=bool(hf.get("norm_topk_prob", True)))
    if moe["n_shared_experts"] < 1:
        raise unsupported(where, "n_shared_experts", moe["n_shared_experts"],
                          "transformers always builds shared experts (moe_intermediate_size · n_shared_experts wide)")
    return dense, moe


def model_config(hf: dict[str, Any], where: str) -> ModelConfig:
    if "n_routed_experts" not in hf:
        raise unsupported(where, "n_routed_experts", None, "DeepSeek-V3 config.json needs it")
    # decoder_fields reads the fields every family shares; RoPE (YaRN allowed) is read here.
    model, moe = decoder_fields({**hf, "num_experts": hf["n_routed_experts"], "rope_scaling": None,
                                 "rope_parameters": {"rope_type": "default"}}, where)
    model.update(rope_fields(hf, where))
    n_heads = model["n_heads"]
    if model.pop("n_kv_heads") != n_heads:
        raise unsupported(where, "num_key_value_heads", hf.get("num_key_value_heads"),
                          f"DeepSeek-V3 needs it equal to num_attention_heads = {n_heads}")
    dense, moe = sigmoid_moe_fields(hf, where, model, moe)
    q_lora = hf.get("q_lora_rank")
    model["rope_layout"] = "interleaved" if hf.get("rope_interleave", True) else "half"
    return ModelConfig(**model, n_dense_layers=dense, ffn_hidden=int(hf.get("intermediate_size", 1)),
                       kv_lora_rank=int(hf["kv_lora_rank"]), q_lora_rank=int(q_lora) if q_lora else None,
                       qk_nope_head_dim=int(hf["qk_nope_head_dim"]), qk_rope_head_dim=int(hf["qk_rope_head_dim"]),
                       v_head_dim=int(hf["v_head_dim"]), moe=MoEConfig(**moe))


def moe_config_json(cfg: ModelConfig) -> dict[str, Any]:
    """The routing fields DeepSeek-V3 and GLM-4.5 share, written back."""
    moe = cfg.moe
    return {"n_routed_experts": moe.n_experts, "n_shared_experts": moe.n_shared_experts,
            "moe_intermediate_size": moe.expert_hidden, "intermediate_size": cfg.ffn_hidden,
            "first_k_dense_replace": cfg.n_dense_layers, "n_group": moe.n_group, "topk_group": moe.topk_group,
            "routed_scaling_factor": moe.routed_scaling_factor, "num_nextn_predict_layers": cfg.mtp_depth,
            "rope_parameters": rope_parameters(cfg)}


def config_json(cfg: ModelConfig, tokenizer: Tokenizer, dtype: torch.dtype) -> dict[str, Any]:
    out = decoder_config_json(cfg, MODEL_TYPE, ARCHITECTURE, tokenizer, dtype)
    del out["num_experts"]
    out.update(moe_config_json(cfg))
    out.update(kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
               qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, head_dim=cfg.qk_rope_head_dim,
               num_key_value_heads=cfg.n_heads, rope_interleave=cfg.rope_layout == "interleaved")
    return out


def sigmoid_routing_refusals(cfg: ModelConfig, label: str) -> list[Refusal]:
    """What a DeepSeek-V3-style family (sigmoid, correction bias, shared experts) refuses."""
    moe = cfg.moe
    checks = [
        (moe.score_func == "sigmoid", "model.moe.score_func", moe.score_func, f"{label} routes with sigmoid scores"),
        (moe.activation == "swiglu", "model.moe.activation", moe.activation, f"{label} uses SwiGLU experts"),
        (moe.n_shared_experts >= 1, "model.moe.n_shared_experts", moe.n_shared_experts,
         f"{label} always has shared experts"),
        (moe.token_rounding_tile == 1, "model.moe.token_rounding_tile", moe.token_rounding_tile,
         f"rounding changes which experts tokens reach; {label} routes plain group-limited top-k"),
        (cfg.clip_qkv is None, "model.clip_qkv", cfg.clip_qkv, f"{label} has no clip_qkv"),
        (cfg.attention_bias in ("none", "qkv"), "model.attention_bias", cfg.attention_bias,
         f"{label} has no output-projection bias"),
        *gpt_oss_era_checks(cfg, label),
        (moe.shared_expert_hidden is None, "model.moe.shared_expert_hidden", moe.shared_expert_hidden,
         f"{label}'s shared experts are model.moe.expert_hidden wide"),
    ]
    return [Refusal(name, value, why) for ok, name, value, why in checks if not ok]


def export_refusals(cfg: ModelConfig) -> list[Refusal]:
    return sigmoid_routing_refusals(cfg, LABEL)


def correction_bias_refusals(cfg: ModelConfig) -> list[Refusal]:
    """An import must apply the files' e_score_correction_bias: only aux-free balancing adds it to the choice."""
    if cfg.moe.load_balance == "aux_free":
        return []
    return [Refusal("model.moe.load_balance", cfg.moe.load_balance,
                    "the files' e_score_correction_bias chooses experts only under 'aux_free' (set "
                    "model.moe.bias_update_rate = 0 to keep it fixed)")]


def tensor_names(cfg: ModelConfig) -> dict[str, str]:
    names = embedding_names(cfg)
    attention = {"wkv_a": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj"}
    attention.update({"wq": "q_proj"} if cfg.q_lora_rank is None else
                     {"wq_a": "q_a_proj", "q_a_norm": "q_a_layernorm", "wq_b": "q_b_proj"})
    for i in range(cfg.n_layers + cfg.mtp_depth):
        layer = {f"layers.{i}.attention.{a}.weight": f"model.layers.{i}.self_attn.{b}.weight"
                 for a, b in attention.items()}
        layer.update(moe_layer_names(cfg, i))
        names.update(as_mtp_block(cfg, i, layer))
    return names


def as_mtp_block(cfg: ModelConfig, i: int, layer: dict[str, str]) -> dict[str, str]:
    """Layer i's names as they are for a main block; past n_layers, an MTP module's block (`mtp.{k}.block.*`)
    and the module's own tensors (enorm, hnorm, eh_proj, shared_head.norm)."""
    if i < cfg.n_layers:
        return layer
    ours, theirs = f"mtp.{i - cfg.n_layers}", f"model.layers.{i}"
    names = {name.replace(f"layers.{i}.", f"{ours}.block.", 1): hf for name, hf in layer.items()}
    names.update({f"{ours}.enorm.weight": f"{theirs}.enorm.weight", f"{ours}.hnorm.weight": f"{theirs}.hnorm.weight",
                  f"{ours}.eh_proj.weight": f"{theirs}.eh_proj.weight",
                  f"{ours}.norm.weight": f"{theirs}.shared_head.norm.weight"})
    return names


def mtp_shared_copies(cfg: ModelConfig) -> dict[str, str]:
    """On-disk name -> the moetrain tensor it copies: each MTP layer's embedding and output head, which moetrain
    shares with the main model (import checks the copies equal them, export writes them)."""
    head = "tok_embeddings.weight" if cfg.tie_embeddings else "output.weight"
    copies = {}
    for i in range(cfg.n_layers, cfg.n_layers + cfg.mtp_depth):
        copies[f"model.layers.{i}.embed_tokens.weight"] = "tok_embeddings.weight"
        copies[f"model.layers.{i}.shared_head.head.weight"] = head
    return copies


def moe_layer_names(cfg: ModelConfig, i: int) -> dict[str, str]:
    """Norms, dense FFN or router + correction bias + shared experts of layer i (DeepSeek-V3 and GLM-4.5 names)."""
    ours, theirs = f"layers.{i}", f"model.layers.{i}"
    names = {f"{ours}.attention_norm.weight": f"{theirs}.input_layernorm.weight",
             f"{ours}.ffn_norm.weight": f"{theirs}.post_attention_layernorm.weight"}
    ffn = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))
    if i < cfg.n_dense_layers:
        names.update((f"{ours}.feed_forward.{a}.weight", f"{theirs}.mlp.{b}.weight") for a, b in ffn)
    else:
        names[f"{ours}.moe.router.weight"] = f"{theirs}.mlp.gate.weight"
        names[f"{ours}.moe.expert_bias"] = f"{theirs}.mlp.gate.e_score_correction_bias"
        names.update((f"{ours}.moe.shared_expert.{a}.weight", f"{theirs}.mlp.shared_experts.{b}.weight")
                     for a, b in ffn)
    return names


def skipped_tensors(cfg: ModelConfig, name: str) -> bool:
    """Multi-token-prediction layers past the job's model.mtp_depth (a job may drop the deeper ones): not read."""
    prefix = "model.layers."
    if not name.startswith(prefix):
        return False
    index = name[len(prefix):].split(".", 1)[0]
    return index.isdigit() and int(index) >= cfg.n_layers + cfg.mtp_depth


FAMILY = Family(
    model_type=MODEL_TYPE, architecture=ARCHITECTURE, label=LABEL, field_names=FIELD_NAMES,
    export_key={"attention_kind": "mla"}, model_config=model_config,
    config_json=config_json, export_refusals=export_refusals, tensor_names=tensor_names,
    expert_names=per_expert_names, fused_expert_names=fused_expert_names, skipped_tensors=skipped_tensors,
    float32_names=FLOAT32_NAMES, import_refusals=correction_bias_refusals, shared_copies=mtp_shared_copies,
)
