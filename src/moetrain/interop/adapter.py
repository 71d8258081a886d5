"""What a Hugging Face family declares: the `Family` adapter every module in `interop/families/` builds.

A family is data plus pure functions: its config.json <-> ModelConfig mapping, the names its
tensors have on disk, and what it refuses. The shared code (`config_map`, `hf_io`) does all the
reading, writing and sharding through this interface and knows no family by name. This module
defines the interface; it must not read files, touch process groups or name a family.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from moetrain.config.model import ModelConfig
from moetrain.data.tokenizer import Tokenizer


class Refusal(NamedTuple):
    """A moetrain option a family cannot represent: `field = value`, and why (for a one-line ConfigError)."""

    field: str
    value: Any
    why: str


@dataclass(frozen=True)
class Family:
    """One Hugging Face model family (a `model_type`), as the shared import/export code needs it.

    Tensor names: `tensor_names` maps every moetrain state entry other than the routed experts
    (parameters, and buffers such as a routing correction bias) to its name ON DISK, so a family
    whose in-memory names differ from its files (Mixtral's `block_sparse_moe.*`) gives the file
    names. A tensor's on-disk shape is the moetrain tensor's shape; only the routed experts change
    layout: moetrain's stacked `w1` [E, d, 2n] (gate | up) and `w2` [E, n, d] are stored in one of
    three layouts:

    - per expert (`expert_names`: gate [n, d], up [n, d], down [d, n]), what save_pretrained writes for
      most families; where the family also has a fused layout it is read too (`fused_expert_names`:
      gate_up [E, 2n, d] with gate | up halves, down [E, d, n]);
    - fused and interleaved (`interleaved_expert_names`, GPT-OSS, on disk as in memory): gate_up
      [E, d, 2n] applied as x @ W with gate = [..., 0::2] and up = [..., 1::2], its bias [E, 2n]
      interleaved alike, down [E, n, d] and its bias [E, d]. A family that sets it reads and writes
      only that layout (its `expert_names` is None).

    Which family exports a model is `export_key`: model fields (or properties such as
    `ModelConfig.attention_kind`) and the values they must have; no two families' keys can match
    the same model.
    """

    model_type: str  # config.json "model_type", the registry key
    architecture: str  # config.json "architectures"[0], the transformers class
    label: str  # the family's name in messages
    # moetrain architecture field (every one of `families.base.ARCH_FIELDS`) -> what fixes it in config.json,
    # for messages.
    field_names: dict[str, str]
    # The moetrain fields, with values, that make a ModelConfig this family's kind of model for export
    # (dotted for MoE fields: "moe.score_func"); no two families may have the same key.
    export_key: dict[str, Any]
    # config.json -> ModelConfig (RoPE in the "half" layout); raises a one-line ConfigError for what
    # the family's config.json may say but moetrain does not compute the same way. Args: (config, where).
    model_config: Callable[[dict[str, Any], str], ModelConfig]
    # ModelConfig -> config.json, with the tokenizer's special ids and the files' dtype.
    config_json: Callable[[ModelConfig, Tokenizer, torch.dtype], dict[str, Any]]
    # Every reason a ModelConfig matching `export_key` still cannot be exported, most basic first.
    export_refusals: Callable[[ModelConfig], list[Refusal]]
    # moetrain name -> on-disk name of every tensor except the routed experts.
    tensor_names: Callable[[ModelConfig], dict[str, str]]
    # (layer, expert) -> on-disk (gate, up, down) names of one routed expert: the layout export writes.
    expert_names: Callable[[int, int], tuple[str, str, str]] | None
    # layer -> on-disk (gate_up, down) names of a layer's experts stored fused; None: no fused layout.
    fused_expert_names: Callable[[int], tuple[str, str]] | None = None
    # layer -> on-disk (gate_up, gate_up_bias, down, down_bias) names in the interleaved layout (see above).
    interleaved_expert_names: Callable[[int], tuple[str, str, str, str]] | None = None
    # (cfg, on-disk name) -> whether the files may hold this tensor though the job computes nothing with it
    # (DeepSeek-V3's multi-token-prediction layers past model.mtp_depth): import skips it instead of refusing.
    skipped_tensors: Callable[[ModelConfig, str], bool] | None = None
    # cfg -> {on-disk name: moetrain name}: tensors the files hold as copies of one moetrain tensor (DeepSeek-V3's
    # MTP layers repeat the embedding and head): import checks each copy equals it, export writes it again.
    shared_copies: Callable[[ModelConfig], dict[str, str]] | None = None
    # Endings of on-disk names an export writes in float32 whatever its dtype (what transformers keeps in
    # float32: DeepSeek-V3's router and correction bias, `_keep_in_fp32_modules_strict`).
    float32_names: tuple[str, ...] = ()
    # What a job importing this family's files must set beyond the architecture fields for the files to
    # mean the same model (DeepSeek-V3's correction bias chooses experts only under aux-free balancing).
    import_refusals: Callable[[ModelConfig], list[Refusal]] | None = None


def gpt_oss_era_checks(cfg: ModelConfig, label: str) -> list[tuple[bool, str, Any, str]]:
    """(ok, field, value, why) of the options only GPT-OSS and Qwen2-MoE carry, for a family without them."""
    moe = cfg.moe
    return [
        (not cfg.attention_sinks, "model.attention_sinks", cfg.attention_sinks, f"{label} has no attention sinks"),
        (cfg.sliding_window is None, "model.sliding_window", cfg.sliding_window, f"{label} has no sliding window"),
        (not moe.router_bias, "model.moe.router_bias", moe.router_bias, f"{label}'s router has no bias"),
        (not moe.expert_proj_bias, "model.moe.expert_proj_bias", moe.expert_proj_bias,
         f"{label}'s experts have no biases"),
        (not moe.shared_expert_gate, "model.moe.shared_expert_gate", moe.shared_expert_gate,
         f"{label} has no shared expert gate"),
    ]


def plain_top_k_refusals(cfg: ModelConfig, label: str, allow: tuple[str, ...] = ()) -> list[Refusal]:
    """What a family routing plain softmax top-k to SwiGLU experts, with no shared expert, refuses.

    `allow` names the fields (as in the refusals, "model.moe.n_shared_experts") a family does have,
    which it then checks itself.
    """
    moe = cfg.moe
    checks = [
        (moe.score_func == "softmax", "model.moe.score_func", moe.score_func, f"{label} routes with softmax"),
        (moe.activation == "swiglu", "model.moe.activation", moe.activation, f"{label} uses SwiGLU experts"),
        (moe.n_shared_experts == 0, "model.moe.n_shared_experts", moe.n_shared_experts,
         f"{label} has no shared experts"),
        (moe.load_balance != "aux_free", "model.moe.load_balance", moe.load_balance,
         f"its expert bias changes the routing and {label} has no place for it"),
        (moe.token_rounding_tile == 1, "model.moe.token_rounding_tile", moe.token_rounding_tile,
         f"rounding changes which experts tokens reach; {label} routes plain top-k"),
        (cfg.mtp_depth == 0, "model.mtp_depth", cfg.mtp_depth, f"{label} has no multi-token-prediction layers"),
        (cfg.attention_bias == "none", "model.attention_bias", cfg.attention_bias,
         f"{label}'s attention projections have no bias"),
        *gpt_oss_era_checks(cfg, label),
        (moe.n_group == 1, "model.moe.n_group", moe.n_group, f"{label} routes without expert groups"),
        (moe.routed_scaling_factor == 1, "model.moe.routed_scaling_factor", moe.routed_scaling_factor,
         f"{label} does not scale its gate values"),
        (cfg.partial_rotary_factor == 1, "model.partial_rotary_factor", cfg.partial_rotary_factor,
         f"{label} rotates every channel of a head"),
        (cfg.rope_scaling == "none", "model.rope_scaling", cfg.rope_scaling, f"{label} uses the default RoPE"),
    ]
    return [Refusal(name, value, why) for ok, name, value, why in checks if not ok and name not in allow]
