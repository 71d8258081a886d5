"""The [lora] section: low-rank adapters on a frozen base model, what they reach and how they start.

`rank = 0` (the default) trains the whole model. With a rank, every matrix of the chosen `targets`
gains a pair (A, B) with W x + (alpha / rank) · B A x, A drawn as PEFT draws it and B zero, and
only the adapters train. This module holds the section's own fields and checks, and the widths of a
model's targeted matrices (`target_widths`), which the rank may not exceed; the rules that read
another section are JobConfig's. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from moetrain.config.checks import check
from moetrain.config.model import ModelConfig

TARGETS = ("attention", "ffn", "shared_experts", "experts", "router")
"""attention: every attention projection (MLA's low-rank ones too); ffn: the dense layers' feed-forward;
shared_experts: the MoE layers' shared expert; experts: the routed experts' stacked w1/w2; router."""

PARAMETER_TARGETS = ("ffn", "shared_experts", "experts", "router")
"""Targets an exported adapter reaches through PEFT's `target_parameters` (the update folded into the weight),
where PEFT applies no dropout; moetrain folds the router's and routed experts' adapters itself."""


@dataclass
class LoraConfig:
    rank: int = 0
    """Rank of every adapter; 0 = no adapters (full fine-tuning)."""
    alpha: float = 16.0
    """Adapter output scale numerator: the update is (alpha / rank) · B A."""
    dropout: float = 0.0
    """Dropout on an adapter's input (training only); only with attention targets alone, as PEFT can apply
    it only there."""
    targets: list[str] = field(default_factory=lambda: ["attention", "experts"])
    """Which matrices get adapters: any of attention, ffn, shared_experts, experts, router."""
    expert_mode: Literal["per_expert", "shared"] = "per_expert"
    """Routed experts: one adapter per expert, or one adapter every expert of a layer shares."""
    init_from: str | None = None
    """A PEFT adapter directory (adapter_config.json + adapter_model.safetensors) to start the adapters
    from instead of PEFT's initialisation."""

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def validate(self) -> None:
        check(self.rank >= 0, "lora.rank", self.rank, "must be >= 0 (0 = no adapters)")
        check(self.alpha > 0, "lora.alpha", self.alpha, "must be > 0")
        check(0 <= self.dropout < 1, "lora.dropout", self.dropout, "must be in [0, 1)")
        for target in self.targets:
            check(target in TARGETS, "lora.targets", self.targets,
                  f"{target!r} is not a target; valid: {', '.join(TARGETS)}")
        check(len(set(self.targets)) == len(self.targets), "lora.targets", self.targets, "names a target twice")
        if not self.enabled:
            check(self.init_from is None, "lora.init_from", self.init_from, "needs lora.rank > 0")
            return
        check(bool(self.targets), "lora.targets", self.targets, "must name at least one target with lora.rank > 0")
        folded = [t for t in self.targets if t in PARAMETER_TARGETS]
        check(self.dropout == 0 or not folded, "lora.dropout", self.dropout,
              f"must be 0 with targets {', '.join(folded)}: PEFT reaches them through target_parameters (the "
              "update folded into the weight), where no dropout of the input applies")


def target_widths(model: ModelConfig) -> dict[str, int]:
    """Target -> the smallest dimension of its matrices in `model`; targets the model has none of are absent."""
    moe, dim = model.moe, model.dim
    if model.kv_lora_rank is None:
        head_dim = model.attention_head_dim()
        attention = min(dim, (model.n_kv_heads or model.n_heads) * head_dim)
    else:
        attention = min(dim, model.kv_lora_rank, model.q_lora_rank or dim, model.n_heads * model.v_head_dim)
    widths = {"attention": attention}
    if model.n_dense_layers > 0:
        widths["ffn"] = min(dim, model.ffn_hidden)
    if model.n_dense_layers < model.n_layers:
        widths["experts"] = min(dim, moe.expert_hidden)
        widths["router"] = min(dim, moe.n_experts)
        if moe.n_shared_experts > 0:
            widths["shared_experts"] = min(dim, moe.shared_width())
    return widths


def _linear_pairs(model: ModelConfig, target: str) -> list[tuple[int, int]]:
    """(in, out) of every linear layer of one layer's `target` ("attention", "ffn", "shared_experts")."""
    dim = model.dim
    if target == "ffn":
        return [(dim, model.ffn_hidden)] * 2 + [(model.ffn_hidden, dim)]
    if target == "shared_experts":
        width = model.moe.shared_width()
        return [(dim, width)] * 2 + [(width, dim)]
    heads = model.n_heads
    if model.kv_lora_rank is None:
        head_dim, kv_heads = model.attention_head_dim(), model.n_kv_heads or heads
        return [(dim, heads * head_dim), (dim, kv_heads * head_dim), (dim, kv_heads * head_dim),
                (heads * head_dim, dim)]
    q_width = heads * (model.qk_nope_head_dim + model.qk_rope_head_dim)
    query = [(dim, q_width)] if model.q_lora_rank is None else [(dim, model.q_lora_rank), (model.q_lora_rank, q_width)]
    return query + [(dim, model.kv_lora_rank + model.qk_rope_head_dim),
                    (model.kv_lora_rank, heads * (model.qk_nope_head_dim + model.v_head_dim)),
                    (heads * model.v_head_dim, dim)]


def adapter_count(model: ModelConfig, lora: LoraConfig) -> int:
    """Adapter parameters `lora` adds to `model` (0 when off): rank · (in + out) per adapted matrix."""
    if not lora.enabled:
        return 0
    moe, r = model.moe, lora.rank
    n_moe = model.n_layers - model.n_dense_layers
    layers = {"attention": model.n_layers, "ffn": model.n_dense_layers, "shared_experts": n_moe}
    total = 0
    for target in lora.targets:
        if target in layers:
            total += layers[target] * sum(r * (a + b) for a, b in _linear_pairs(model, target))
        elif target == "router":
            total += n_moe * r * (model.dim + moe.n_experts)
        elif target == "experts":
            stacks = moe.n_experts if lora.expert_mode == "per_expert" else 1
            width = moe.expert_hidden if moe.activation == "gelu" else 2 * moe.expert_hidden
            total += n_moe * stacks * r * (model.dim + width + moe.expert_hidden + model.dim)
    return total
