"""The registry of Hugging Face families: config.json `model_type` -> its `Family` adapter.

Adding a family is adding its module next to these and its FAMILY to `FAMILIES` below (an explicit
import, so the import graph shows every family). This module chooses a family, for a directory or
for an export; it converts nothing itself and touches no files.
"""

from __future__ import annotations

from typing import Any

from moetrain.config.model import ModelConfig
from moetrain.errors import ConfigError
from moetrain.interop.adapter import Family
from moetrain.interop.families import deepseek_v3, glm4_moe, gpt_oss, mixtral, olmoe, qwen2_moe, qwen3_moe

FAMILIES: dict[str, Family] = {family.model_type: family for family in (
    qwen3_moe.FAMILY, olmoe.FAMILY, mixtral.FAMILY, qwen2_moe.FAMILY, gpt_oss.FAMILY, deepseek_v3.FAMILY,
    glm4_moe.FAMILY)}
SUPPORTED = ", ".join(f"{family.model_type} ({family.architecture})" for family in FAMILIES.values())


def family(model_type: Any, where: str = "config.json") -> Family:
    """The adapter of a config.json `model_type`, else a one-line ConfigError listing the supported ones."""
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise ConfigError(f"{where}: model_type = {model_type!r} is not a supported family; supported: {SUPPORTED}")
    return FAMILIES[model_type]


def _field(cfg: ModelConfig, name: str) -> Any:
    return getattr(cfg.moe, name[4:]) if name.startswith("moe.") else getattr(cfg, name)


def export_family_of(cfg: ModelConfig) -> Family:
    """The family a moetrain architecture exports to, or one ConfigError line saying what does not fit.

    The family is the one whose `export_key` the architecture matches; then the first of its
    refusals, if any, is the error.
    """
    match = next((f for f in FAMILIES.values() if all(_field(cfg, k) == v for k, v in f.export_key.items())), None)
    if match is None:
        raise _cannot_export(*_key_mismatch(cfg))
    refusals = match.export_refusals(cfg)
    if refusals:
        raise _cannot_export(*refusals[0])
    return match


def _key_mismatch(cfg: ModelConfig) -> tuple[str, Any, str]:
    """(field, value, why) for an architecture no family's export_key matches: the first key field some
    family wants otherwise, with what each of those families wants."""
    for name in dict.fromkeys(k for f in FAMILIES.values() for k in f.export_key):
        value = _field(cfg, name)
        wants = [(f.label, f.export_key[name]) for f in FAMILIES.values()
                 if name in f.export_key and f.export_key[name] != value]
        if wants:
            (first, want), rest = wants[0], wants[1:]
            why = ", ".join([f"{first} needs {want!r}", *(f"{label} {wanted!r}" for label, wanted in rest)])
            return f"model.{name}", value, why
    raise AssertionError("an architecture matching no export_key differs from one in some field")


def _cannot_export(name: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"{name} = {value!r} cannot be exported to a Hugging Face family ({SUPPORTED}): {why}")
