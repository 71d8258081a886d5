"""The [model.moe] section: the MoE layers' router and experts, and their own checks.

Only rules among MoE fields live here; a rule that also reads another model field is ModelConfig's,
one that reads another section is JobConfig's. No parsing, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moetrain.config.checks import check, check_nonnegative, check_positive


@dataclass
class MoEConfig:
    n_experts: int = 16
    """Routed experts per MoE layer."""
    top_k: int = 2
    """Routed experts each token is sent to."""
    expert_hidden: int = 128
    """Hidden width of one routed expert's FFN."""
    n_shared_experts: int = 0
    """Experts every token goes through beside the routed ones (DeepSeekMoE); each expert_hidden wide."""
    shared_expert_hidden: int | None = None
    """Hidden width of the (fused) shared expert; None = expert_hidden · n_shared_experts. Qwen2-MoE's
    shared expert has a width of its own (shared_expert_intermediate_size)."""
    shared_expert_gate: bool = False
    """Scale the shared expert's output per token by sigmoid(w·x), a learned [1, dim] gate (Qwen2-MoE)."""
    router_bias: bool = False
    """A bias on the router's logits (GPT-OSS)."""
    expert_proj_bias: bool = False
    """Biases on every routed expert's input (gate/up) and output projections (GPT-OSS)."""
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores: softmax over all experts, or an independent sigmoid per expert (DeepSeek-V3)."""
    renormalize: bool = True
    """Rescale the selected experts' scores to sum to 1 (Hugging Face's norm_topk_prob). Refused with
    top_k = 1, where every gate would be 1 and the router would get no gradient from the LM loss."""
    activation: Literal["swiglu", "gelu", "clamped_swiglu"] = "swiglu"
    """The experts' activation: silu(gate)·up; exact GELU; or GPT-OSS's clamped SwiGLU
    (clamp(up, ±swiglu_limit) + 1) · g · sigmoid(swiglu_alpha · g) with g = min(gate, swiglu_limit)."""
    swiglu_alpha: float = 1.702
    """clamped_swiglu only: the sigmoid's slope alpha (GPT-OSS's swiglu_alpha)."""
    swiglu_limit: float = 7.0
    """clamped_swiglu only: the clamp limit (GPT-OSS's swiglu_limit)."""
    impl: Literal["loop", "grouped", "memory_efficient"] = "memory_efficient"
    """loop: per-expert reference; grouped: grouped GEMM + autograd; memory_efficient: SonicMoE backward."""
    load_balance: Literal["aux_loss", "aux_free", "none"] = "aux_loss"
    """Load balancing: an auxiliary loss (Switch), a per-expert routing bias with no loss (DeepSeek-V3), or none."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balance auxiliary loss (load_balance = 'aux_loss')."""
    bias_update_rate: float = 1e-3
    """Step of the sign-based expert-bias update per optimizer step (load_balance = 'aux_free')."""
    token_rounding_tile: int = 1
    """Token rounding (tile-aware routing): per-expert token counts rounded to this multiple; 1 = off."""
    z_loss_coef: float = 0.0
    """Router z-loss (ST-MoE, arXiv 2202.08906): coef · mean over tokens of logsumexp(router logits)^2,
    token-weighted like the LM loss; 0 = off. Logged apart from the balance loss."""
    aux_loss_scope: Literal["microbatch", "global_batch"] = "microbatch"
    """Where the balance loss's expert shares f_e and mean probabilities P_e are measured: each
    microbatch on its own, or the whole step (every microbatch on every data-parallel rank; costs a
    no-grad routing pre-pass per step, see docs/guides/models.md)."""
    n_group: int = 1
    """Group-limited routing (DeepSeek-V3's n_group): the experts are split into this many equal groups
    of consecutive experts; each token first picks `topk_group` groups by the sum of the top-2 choice
    scores inside each, then its top_k experts inside those groups. 1 = plain top-k."""
    topk_group: int = 1
    """Groups each token may route into under group-limited routing (<= n_group)."""
    routed_scaling_factor: float = 1.0
    """Multiplies the routed experts' gate values after renormalisation (DeepSeek-V3: 2.5); the shared
    experts are not scaled."""

    def shared_width(self) -> int:
        """Hidden width of the shared expert (0 without one)."""
        if self.n_shared_experts == 0:
            return 0
        return self.shared_expert_hidden or self.expert_hidden * self.n_shared_experts

    def validate(self) -> None:
        """Raise ConfigError (one line) at the first invalid [model.moe] field."""
        check_positive(self, "model.moe", ("n_experts", "top_k", "expert_hidden", "token_rounding_tile"))
        check_nonnegative(self, "model.moe", ("n_shared_experts", "aux_loss_coef", "bias_update_rate", "z_loss_coef"))
        self._validate_group_routing()
        if self.shared_expert_hidden is not None:
            check(self.shared_expert_hidden >= 1 and self.n_shared_experts >= 1, "model.moe.shared_expert_hidden",
                  self.shared_expert_hidden, "must be >= 1, with model.moe.n_shared_experts >= 1, or None")
        check(not self.shared_expert_gate or self.n_shared_experts >= 1, "model.moe.shared_expert_gate",
              self.shared_expert_gate, "needs a shared expert (model.moe.n_shared_experts >= 1)")
        for name in ("swiglu_alpha", "swiglu_limit"):  # also when unused: no clamped SwiGLU has them <= 0
            check(getattr(self, name) > 0, f"model.moe.{name}", getattr(self, name), "must be > 0")
        check(self.top_k <= self.n_experts, "model.moe.top_k", self.top_k,
              f"must be <= model.moe.n_experts = {self.n_experts}")

    def _validate_group_routing(self) -> None:
        check(self.n_group >= 1 and self.n_experts % self.n_group == 0, "model.moe.n_group", self.n_group,
              f"must be a positive divisor of model.moe.n_experts = {self.n_experts}")
        if self.n_group > 1:
            check(self.n_experts // self.n_group >= 2, "model.moe.n_group", self.n_group,
                  "groups are scored by their top-2 experts, so each needs >= 2 experts")
        check(1 <= self.topk_group <= self.n_group, "model.moe.topk_group", self.topk_group,
              f"must be in [1, model.moe.n_group = {self.n_group}]")
        check(self.top_k <= self.topk_group * (self.n_experts // self.n_group), "model.moe.top_k", self.top_k,
              f"must be <= the experts in topk_group = {self.topk_group} groups")
        check(self.routed_scaling_factor > 0, "model.moe.routed_scaling_factor", self.routed_scaling_factor,
              "must be > 0")
