"""A Hugging Face directory's architecture as moetrain sees it: config.json <-> ModelConfig, checks, JobConfig.

Goes through the family registry (`interop.families`) for everything family-specific and knows no
family by name. It reads config.json only: no tensors, no process groups, no model building.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from moetrain.config.job import JobConfig
from moetrain.config.model import ModelConfig
from moetrain.data.tokenizer import Tokenizer
from moetrain.errors import ConfigError
from moetrain.interop import families
from moetrain.interop.config_json import read_config_json
from moetrain.interop.families.base import ARCH_FIELDS

MLA_FIELDS = ("q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
YARN_FIELDS = tuple(name for name in ARCH_FIELDS if name.startswith("rope_yarn_"))


def read_hf_config(model_dir: str | Path) -> tuple[str, dict[str, Any]]:
    """(family, config.json contents) of a supported Hugging Face model directory, else a one-line ConfigError."""
    path, hf = read_config_json(model_dir)
    family = families.family(hf.get("model_type") if isinstance(hf, dict) else None, str(path))
    return family.model_type, hf


def model_config_from_hf(hf: dict[str, Any], family: str, where: str = "config.json") -> ModelConfig:
    """The moetrain architecture of a Hugging Face config (rope_layout "half": no permutation needed)."""
    adapter = families.family(family, where)
    try:
        return adapter.model_config(hf, where)
    except (KeyError, TypeError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"{where}: missing or malformed field {err}") from None


def architecture(cfg: ModelConfig) -> dict[str, Any]:
    """The fields of `cfg` a Hugging Face directory fixes, with defaults resolved (head_dim, n_kv_heads)."""
    values = {name: getattr(cfg.moe, name[4:]) if name.startswith("moe.") else getattr(cfg, name)
              for name in ARCH_FIELDS}
    values["n_kv_heads"] = cfg.n_kv_heads or cfg.n_heads
    values["head_dim"] = cfg.attention_head_dim()
    if cfg.n_dense_layers == 0:
        values["ffn_hidden"] = None  # unused without dense layers
    # Equal computations compare equal: the window of each layer, the shared expert's actual width,
    # the clamp constants only where the clamped activation uses them.
    values["layer_types"] = (None if cfg.sliding_window is None else
                             ["full_attention" if cfg.window_of(i) is None else "sliding_attention"
                              for i in range(cfg.n_layers)])
    values["moe.shared_expert_hidden"] = cfg.moe.shared_width() or None
    if cfg.moe.activation != "clamped_swiglu":
        values["moe.swiglu_alpha"] = values["moe.swiglu_limit"] = None
    if cfg.kv_lora_rank is None:
        values.update(dict.fromkeys(MLA_FIELDS))  # unused by grouped-query attention
        # The files of grouped-query families are in the "half" layout; import permutes q/k rows to either.
        values["rope_layout"] = None
    else:
        # Multi-head latent attention keeps the files' row order, so the layout is part of the architecture.
        values["n_kv_heads"] = values["head_dim"] = None
    if cfg.rope_scaling == "none":
        values.update(dict.fromkeys(YARN_FIELDS))
    return values


def check_architecture(cfg: ModelConfig, model_dir: str | Path) -> tuple[str, dict[str, Any]]:
    """Raise one ConfigError line listing every architecture field where `cfg` and DIR/config.json differ."""
    family, hf = read_hf_config(model_dir)
    where = str(Path(model_dir) / "config.json")
    theirs = model_config_from_hf(hf, family, where)
    want = architecture(theirs)
    have = architecture(cfg)
    field_names = families.family(family).field_names
    diffs = []
    for name, value in have.items():
        expected = want[name]
        same = (math.isclose(value, expected, rel_tol=1e-9) if isinstance(value, float) and isinstance(expected, float)
                else value == expected)
        if not same:
            diffs.append(f"model.{name} = {value!r} but {field_names[name]} gives {expected!r}")
    if cfg.mtp_depth > theirs.mtp_depth:  # fewer is fine: the deeper modules are not read
        diffs.append(f"model.mtp_depth = {cfg.mtp_depth} but num_nextn_predict_layers gives {theirs.mtp_depth}")
    if diffs:
        raise ConfigError(f"model.init_from = 'hf:{model_dir}': the job's architecture differs from {where}: "
                          + "; ".join(diffs))
    adapter = families.family(family)
    for name, value, why in adapter.import_refusals(cfg) if adapter.import_refusals else ():
        raise ConfigError(f"model.init_from = 'hf:{model_dir}': {name} = {value!r} is invalid: {why}")
    return family, hf


def export_family(cfg: ModelConfig) -> str:
    """The Hugging Face family (model_type) a moetrain architecture is, or one ConfigError line saying what
    does not fit."""
    return families.export_family_of(cfg).model_type


def hf_config(cfg: ModelConfig, family: str, tokenizer: Tokenizer, dtype: torch.dtype) -> dict[str, Any]:
    """config.json for a moetrain architecture of `family`, with the tokenizer's special ids."""
    return families.family(family).config_json(cfg, tokenizer, dtype)


def hf_job_config(model_dir: str | Path) -> JobConfig:
    """The JobConfig that fine-tunes a Hugging Face directory as it is: the architecture from config.json
    (RoPE kept in the "half" layout, `model.init_from = "hf:DIR"`), the directory's tokenizer.json as
    `data.tokenizer` when it has one (else the byte tokenizer), seq_len clamped to the model's context."""
    model_dir = Path(model_dir)
    family, hf = read_hf_config(model_dir)
    model_cfg = replace(model_config_from_hf(hf, family, str(model_dir / "config.json")), init_from=f"hf:{model_dir}")
    cfg = JobConfig(model=model_cfg)
    cfg.data.seq_len = min(cfg.data.seq_len, model_cfg.max_seq_len)
    cfg.data.tokenizer = str(model_dir) if (model_dir / "tokenizer.json").is_file() else "byte"
    cfg.validate()
    return cfg
