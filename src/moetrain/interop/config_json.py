"""Reading a Hugging Face directory's config.json, and the fields every supported family reads the same way.

Families compose these helpers in their `model_config` / `config_json`; this module knows no family
by name, reads no tensors and touches no process group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from moetrain.config.model import ModelConfig
from moetrain.data.chat import read_json_object
from moetrain.data.tokenizer import Tokenizer
from moetrain.errors import ConfigError


def hf_dir(init_from: str) -> Path:
    """The directory of a `model.init_from = "hf:DIR"` value."""
    if not init_from.startswith("hf:") or len(init_from) <= 3:
        raise ConfigError(f"model.init_from = {init_from!r} is invalid: must be 'hf:DIR'")
    return Path(init_from[3:])


def read_config_json(model_dir: str | Path) -> tuple[Path, Any]:
    """(path, parsed contents) of DIR/config.json, else a one-line ConfigError naming what is missing."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ConfigError(f"Hugging Face model directory {str(model_dir)!r} does not exist")
    path = model_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path} is missing: {str(model_dir)!r} is not a Hugging Face model directory")
    return path, read_json_object(path)


# Bounds on what a config.json may say before anything is built from it: families loop over the
# layers (which are dense, which MoE) and the reader over layers x experts, so a count of 10**12
# would hang before the memory check could refuse it. Far above any published model.
MAX_LAYERS = 1 << 12
MAX_COUNT = 1 << 31  # any other size or count: beyond int32 no tensor dimension is meant


def integer(hf: dict[str, Any], key: str, where: str, default: Any = None, low: int = 1,
            high: int = MAX_COUNT) -> int:
    """The integer `hf[key]` (or `default`) in [low, high], else one ConfigError line (strings, floats, bools too)."""
    value = hf.get(key, default) if default is not None else hf[key]
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ConfigError(f"{where}: {key} = {value!r:.40} is invalid: must be an integer in [{low}, {high}]")
    return value


def unsupported(where: str, key: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"{where}: {key} = {value!r} is not supported: {why}")


def rope_theta(hf: dict[str, Any], where: str) -> float:
    """The RoPE base, from transformers 5's `rope_parameters` or the older top-level fields; default RoPE only."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise unsupported(where, "rope_type", rope_type, "moetrain computes the default RoPE only")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def num_experts(hf: dict[str, Any], where: str = "config.json") -> int:
    # Some families (Mixtral) call it num_local_experts.
    return integer(hf, "num_experts" if "num_experts" in hf else "num_local_experts", where, low=0)


def decoder_fields(hf: dict[str, Any], where: str, allow: tuple[str, ...] = ()) -> tuple[dict[str, Any],
                                                                                      dict[str, Any]]:
    """(ModelConfig fields, MoEConfig fields) of a softmax top-k MoE decoder with SwiGLU experts and RMSNorm.

    Refuses, in one line, what such a config.json may say but moetrain does not compute the same way,
    except the keys in `allow`, which the calling family reads itself.
    """
    for key, ok, why in (
        ("hidden_act", hf.get("hidden_act", "silu") == "silu", "experts and FFNs are SwiGLU (silu)"),
        ("attention_bias", not hf.get("attention_bias", False), "moetrain's projections have no bias"),
        ("attention_dropout", not hf.get("attention_dropout", 0.0), "moetrain has no dropout"),
        ("use_sliding_window", not hf.get("use_sliding_window", False), "moetrain attends to the whole document"),
    ):
        if not ok and key not in allow:
            raise unsupported(where, key, hf.get(key), why)
    theta = rope_theta(hf, where)
    dim, n_heads = integer(hf, "hidden_size", where), integer(hf, "num_attention_heads", where)
    n_layers = integer(hf, "num_hidden_layers", where, high=MAX_LAYERS)
    n_kv_heads = integer(hf, "num_key_value_heads", where, default=n_heads) if hf.get("num_key_value_heads") \
        else n_heads
    for key in ("vocab_size", "num_experts_per_tok", "max_position_embeddings", "intermediate_size",
                "moe_intermediate_size", "head_dim"):
        if hf.get(key) is not None:
            integer(hf, key, where)
    # Which layers are MoE (Qwen2/3-MoE and kin): a step of 0 would divide by zero in the family.
    if "decoder_sparse_step" in hf:
        integer(hf, "decoder_sparse_step", where, high=MAX_LAYERS)
    mlp_only = hf.get("mlp_only_layers")
    if mlp_only is not None and not (isinstance(mlp_only, list) and all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n_layers for i in mlp_only)):
        raise ConfigError(f"{where}: mlp_only_layers = {mlp_only!r:.60} is invalid: must be a list of layer "
                          f"indices in [0, {n_layers})")
    experts = num_experts(hf, where)
    if experts < 1:
        raise unsupported(where, "num_experts", experts, "only MoE models are supported")
    model = dict(vocab_size=int(hf["vocab_size"]), dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                 max_seq_len=int(hf.get("max_position_embeddings", 4096)), rope_theta=theta,
                 rope_layout="half", norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                 tie_embeddings=bool(hf.get("tie_word_embeddings", False)))
    moe = dict(n_experts=experts, top_k=int(hf["num_experts_per_tok"]), n_shared_experts=0,
               score_func="softmax", renormalize=bool(hf.get("norm_topk_prob", False)), activation="swiglu",
               aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.01)))
    return model, moe


def decoder_config_json(cfg: ModelConfig, model_type: str, architecture: str, tokenizer: Tokenizer,
                        dtype: torch.dtype) -> dict[str, Any]:
    """The config.json fields `decoder_fields` reads, written back, with the tokenizer's ids and the dtype."""
    moe = cfg.moe
    return {
        "architectures": [architecture], "model_type": model_type, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False, "attention_dropout": 0.0, "num_experts": moe.n_experts,
        "num_experts_per_tok": moe.top_k, "norm_topk_prob": moe.renormalize,
        "router_aux_loss_coef": moe.aux_loss_coef, "output_router_logits": False, "initializer_range": 0.02,
        "use_cache": True, "bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id,
        "pad_token_id": tokenizer.pad_id, "dtype": str(dtype).removeprefix("torch."),
    }


YARN_KEYS = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "truncate"}


def rope_fields(hf: dict[str, Any], where: str) -> dict[str, Any]:
    """ModelConfig RoPE fields of a config.json with default or YaRN RoPE (`rope_parameters`, or the older
    top-level `rope_theta` + `rope_scaling`); a one-line ConfigError for any other kind."""
    params = dict(hf.get("rope_parameters") or {})
    if not params:
        params = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 10000.0)}
    rope_type = params.get("rope_type") or params.get("type") or "default"
    out: dict[str, Any] = {"rope_theta": float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))}
    if rope_type == "default":
        return out
    if rope_type != "yarn":
        raise unsupported(where, "rope_type", rope_type, "moetrain computes default and yarn RoPE only")
    extra = sorted(set(params) - YARN_KEYS - {"partial_rotary_factor"})
    if extra or params.get("factor") is None:
        key = extra[0] if extra else "factor"
        raise unsupported(where, f"rope_parameters.{key}", params.get(key),
                          "moetrain's YaRN takes factor, original_max_position_embeddings, beta_fast, beta_slow, "
                          "mscale, mscale_all_dim and truncate (factor required)")
    out.update(rope_scaling="yarn", rope_yarn_factor=float(params["factor"]),
               rope_yarn_original_max_seq_len=int(params["original_max_position_embeddings"]),
               rope_yarn_beta_fast=float(params.get("beta_fast") or 32.0),
               rope_yarn_beta_slow=float(params.get("beta_slow") or 1.0),
               rope_yarn_mscale=float(params.get("mscale") or 0.0),
               rope_yarn_mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
               rope_yarn_truncate=bool(params.get("truncate", True)))
    return out


def rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    """config.json `rope_parameters` of a ModelConfig (default or YaRN)."""
    if cfg.rope_scaling == "none":
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    out = {"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": cfg.rope_yarn_factor,
           "original_max_position_embeddings": cfg.rope_yarn_original_max_seq_len,
           "beta_fast": cfg.rope_yarn_beta_fast, "beta_slow": cfg.rope_yarn_beta_slow,
           "truncate": cfg.rope_yarn_truncate}
    if cfg.rope_yarn_mscale:
        out["mscale"] = cfg.rope_yarn_mscale
    if cfg.rope_yarn_mscale_all_dim:
        out["mscale_all_dim"] = cfg.rope_yarn_mscale_all_dim
    return out
