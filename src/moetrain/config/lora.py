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
