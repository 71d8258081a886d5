"""MoE feed-forward layer: linear router, top-k selection, routed experts, optional shared expert.

Routing: the router is a linear layer (with a bias under `router_bias`, GPT-OSS);
`routing.select_experts` turns its logits into scores (softmax or sigmoid, float32), chooses the
top-k experts of each token on the scores (plus a per-expert bias under aux-loss-free balancing,
which only affects the choice, never the gate values; DeepSeek-V3's e_score_correction_bias is that
bias), optionally group-limited (`n_group`, `topk_group`), and gives gate values = the chosen
scores, optionally renormalised to sum to 1, times `routed_scaling_factor`. The routed experts are
computed by `experts.routed_experts` (loop / grouped GEMM / memory-efficient, chosen by
`MoEConfig.impl`) on stacked weights `experts.w1` [E, d, 2n] (gate | up, SwiGLU) or [E, d, n] (GELU)
and `experts.w2` [E, n, d], with biases `experts.b1` [E, width of w1] and `experts.b2` [E, d] under
`expert_proj_bias` (GPT-OSS). A shared expert, when configured, is a dense SwiGLU FFN
(`layers.FeedForward`) of width `MoEConfig.shared_width()` added to every token's output, scaled per
token by sigmoid(shared_expert_gate(x)) under `shared_expert_gate` (Qwen2-MoE).

GPT-OSS's router (softmax over the top-k logits it selects) is the softmax router with
`renormalize`: exp(l_i) / Σ_top-k exp(l_j) = p_i / Σ_top-k p_j, and the top-k of the logits are the
top-k of the probabilities, so it needs no routing mode of its own.

After each forward the module exposes `aux_loss` (the load-balancing loss, not multiplied by its
coefficient: of this forward alone under `aux_loss_scope = "microbatch"`, or this forward's exact
part of the whole step's loss under "global_batch", once `set_global_balance` has given it the
step's expert shares; None before that), `router_z` (per-token router z-loss [T], None when its
coefficient is 0) and `tokens_per_expert` (detached, [E]). It holds no distributed code: the
cross-rank sums (expert loads for the bias update, the step's expert counts) happen outside, and
the routed-expert computation is injected (`expert_compute`, `experts.routed_experts` by default;
expert parallelism swaps in one that sends the routed tokens to the ranks owning their experts, and
that declares `runs_alongside`: it then gets the shared expert as `alongside=` to run while the tokens
travel, and returns (routed output, shared output); the sum is the same).
A forward with `statistics=False` (generation's, which never reads them) computes none of the
three and leaves them None.
It does not initialise its parameters: init.py does, and calls `reset_buffers` for the balancing state.
Shape suffixes on local names: T tokens, D model dim, E experts, K top_k.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import Tensor, nn

from moetrain.config.moe import MoEConfig
from moetrain.model.experts import FEW_ASSIGNMENTS, few_token_experts, routed_experts
from moetrain.model.grouped_mm import Activation, ClampedSwiGLU
from moetrain.model.layers import FeedForward, profiler_label
from moetrain.model.routing import (
    balance_fractions,
    global_balance_share,
    round_routing,
    router_z_loss,
    routing_from_topk,
    select_experts,
    switch_aux_loss,
)


def expert_activation(cfg: MoEConfig) -> Activation:
    """The `activation` argument of the expert functions for this config."""
    if cfg.activation == "clamped_swiglu":
        return ClampedSwiGLU(alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)
    return cfg.activation


class RoutedExpertWeights(nn.Module):
    """Stacked expert weights: w1 [E, d, 2n] (gated: gate = [..., :n], up = [..., n:]) or [E, d, n]; w2 [E, n, d];
    under `expert_proj_bias` also b1 [E, width of w1] and b2 [E, d]."""

    bias_names = ("b1", "b2")
    """Parameters that are stacked bias vectors (2-D only because experts are stacked): the optimizer does not
    weight-decay them, as it does not decay any other bias."""

    def __init__(self, dim: int, cfg: MoEConfig):
        super().__init__()
        width = cfg.expert_hidden if cfg.activation == "gelu" else 2 * cfg.expert_hidden
        self.w1 = nn.Parameter(torch.empty(cfg.n_experts, dim, width))
        self.w2 = nn.Parameter(torch.empty(cfg.n_experts, cfg.expert_hidden, dim))
        if cfg.expert_proj_bias:
            self.b1 = nn.Parameter(torch.empty(cfg.n_experts, width))
            self.b2 = nn.Parameter(torch.empty(cfg.n_experts, dim))

    def weights(self) -> tuple[Tensor, Tensor]:
        """(w1, w2) as the expert functions use them; LoRA's subclass (model/lora.py) folds its adapters in."""
        return self.w1, self.w2

    def saving(self, w1: Tensor, w2: Tensor) -> AbstractContextManager:
        """The context the expert functions run in on `weights()`'s (w1, w2): how autograd saves them (LoRA's
        subclass keeps a recipe of its folded weights instead of the weights)."""
        return nullcontext()

    def biases(self) -> dict[str, Tensor]:
        """{"b1": ..., "b2": ...} for the expert functions' keyword arguments; empty without biases."""
        return {"b1": self.b1, "b2": self.b2} if hasattr(self, "b1") else {}


class MoE(nn.Module):
    """Router + routed experts (+ shared expert) on x [..., d]; keeps the balancing state of its layer."""

    def __init__(self, dim: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.dim = dim
        self.router = nn.Linear(dim, cfg.n_experts, bias=cfg.router_bias)
        self.experts = RoutedExpertWeights(dim, cfg)
        self.activation = expert_activation(cfg)
        self.shared_expert = FeedForward(dim, cfg.shared_width()) if cfg.n_shared_experts > 0 else None
        # Qwen2-MoE: the shared expert's output scaled per token by sigmoid(shared_expert_gate(x)).
        self.shared_expert_gate = nn.Linear(dim, 1, bias=False) if cfg.shared_expert_gate else None
        # Aux-loss-free balancing (DeepSeek-V3, arXiv 2408.15664): a bias added to the scores for
        # the top-k choice only. Persistent so a resumed run keeps its balance state.
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts, dtype=torch.float32))
        # Loads accumulated since the last bias update (one optimizer step spans several microbatches).
        self.register_buffer("load_since_update", torch.zeros(cfg.n_experts, dtype=torch.float32),
                             persistent=False)
        # (x, routing, w1, w2, activation, impl[, b1=, b2=, float8=]) -> out, the contract of `routed_experts`. A
        # plain attribute, not a submodule: it holds no parameters or state.
        self.expert_compute: Callable[..., Tensor] = routed_experts
        # train.float8 (set by moetrain.parallel.float8): the routed experts' GEMMs in float8, passed on as `float8=`.
        self.expert_float8: bool = False
        self.aux_loss: Tensor | None = None
        self.router_z: Tensor | None = None
        self.tokens_per_expert: Tensor | None = None
        self.rounding_changes: int = 0
        # The step's expert shares f_e and routed-token count, for the global-batch balance loss.
        self.global_fraction: Tensor | None = None
        self.global_tokens: int = 0
        # True when the step is the next forward's microbatch alone (one microbatch, one rank).
        self.own_counts_are_global: bool = False

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Zero the balancing state (called by init; buffers hold garbage after `to_empty`)."""
        self.expert_bias.zero_()
        self.load_since_update.zero_()

    def route(self, logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Router logits [T, E] -> (probs [T, E] rows summing to 1, topk_idx [T, k], gates [T, k]), >= float32."""
        choice_bias_E = self.expert_bias if self.cfg.load_balance == "aux_free" else None
        return select_experts(logits, self.cfg.score_func, self.cfg.top_k, self.cfg.renormalize, choice_bias_E,
                              self.cfg.n_group, self.cfg.topk_group, self.cfg.routed_scaling_factor)

    @torch.no_grad()
    def set_global_balance(self, counts: Tensor, n_tokens: int) -> None:
        """The step's assignments per expert [E] and routed tokens, summed over microbatches and ranks."""
        self.global_fraction = balance_fractions(counts, n_tokens, self.cfg.top_k)
        self.global_tokens = int(n_tokens)
        self.own_counts_are_global = False

    def balance_on_own_counts(self) -> None:
        """The step is the next forward's microbatch alone: its own counts are the step's (no counting pre-pass)."""
        self.global_fraction, self.global_tokens, self.own_counts_are_global = None, 0, True

    def _balance_loss(self, probs_TE: Tensor, counts_E: Tensor) -> Tensor | None:
        if self.cfg.aux_loss_scope == "microbatch":
            return switch_aux_loss(probs_TE, counts_E, self.cfg.top_k)
        if self.global_fraction is None:
            if not self.own_counts_are_global:
                return None
            n_tokens = probs_TE.shape[0]  # what the pre-pass would have counted: the same routing, the same sums
            return global_balance_share(probs_TE, balance_fractions(counts_E, n_tokens, self.cfg.top_k), n_tokens)
        return global_balance_share(probs_TE, self.global_fraction.to(probs_TE.device), self.global_tokens)

    def _few_tokens(self, x_TD: Tensor) -> bool:
        """Whether this forward is a decode step of generation: inference on CPU, a few tokens, local experts."""
        return (x_TD.shape[0] * self.cfg.top_k <= FEW_ASSIGNMENTS and x_TD.device.type == "cpu"
                and not self.training and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
                and self.expert_compute is routed_experts and self.cfg.token_rounding_tile <= 1)

    def _shared(self, x_TD: Tensor) -> Tensor:
        """The shared expert's output [T, d], gated per token under `shared_expert_gate`."""
        shared_TD = self.shared_expert(x_TD)
        if self.shared_expert_gate is not None:
            shared_TD = torch.sigmoid(self.shared_expert_gate(x_TD)) * shared_TD
        return shared_TD

    def forward(self, x: Tensor, statistics: bool = True) -> Tensor:
        """`statistics=False` (generation's forwards, which never read them): no expert counts, balance loss or
        z-loss; `tokens_per_expert`, `aux_loss` and `router_z` are None after it."""
        shape = x.shape
        x_TD = x.reshape(-1, self.dim)
        few = self._few_tokens(x_TD)  # then the experts run straight from the top-k choice (experts.py)
        overlap_shared = (not few and self.shared_expert is not None
                          and getattr(self.expert_compute, "runs_alongside", False))
        with profiler_label("router"):  # labels in profiler traces
            logits_TE = self.router(x_TD)
            probs_TE, topk_idx_TK, gates_TK = self.route(logits_TE)
        # Dispatch without expert parallelism: the permutation of the token copies into expert order (the
        # row gather and the weighted scatter-add run chunk by chunk inside the experts' op, under "experts").
        with profiler_label("dispatch"):
            if not few:
                routing = routing_from_topk(topk_idx_TK, gates_TK.to(x_TD.dtype), self.cfg.n_experts)
                if self.cfg.token_rounding_tile > 1:
                    routing, self.rounding_changes = round_routing(probs_TE, routing, self.cfg.token_rounding_tile)
        with profiler_label("experts"):
            w1, w2 = self.experts.weights()
            with self.experts.saving(w1, w2):
                if few:
                    out_TD = few_token_experts(x_TD, topk_idx_TK, gates_TK.to(x_TD.dtype), w1, w2, self.activation,
                                               **self.experts.biases())
                else:
                    float8 = {"float8": True} if self.expert_float8 else {}  # the contract's optional keyword
                    # An expert compute that communicates (expert parallelism) runs the shared expert while
                    # its tokens travel and hands its output back; same ops, same sum below.
                    beside = {"alongside": lambda: self._shared(x_TD)} if overlap_shared else {}
                    out_TD = self.expert_compute(x_TD, routing, w1, w2, self.activation, self.cfg.impl,
                                                 **self.experts.biases(), **float8, **beside)
                    if overlap_shared:
                        out_TD, shared_TD = out_TD
        with profiler_label("combine"):  # the routed experts' output joined with the shared expert's
            if self.shared_expert is not None:
                if not overlap_shared:
                    shared_TD = self._shared(x_TD)
                out_TD = out_TD + shared_TD
        if not statistics:
            self.tokens_per_expert = self.aux_loss = self.router_z = None
            return out_TD.reshape(shape)
        counts_E = (torch.bincount(topk_idx_TK.reshape(-1), minlength=self.cfg.n_experts) if few
                    else routing.counts.detach())
        self.tokens_per_expert = counts_E
        self.aux_loss = self._balance_loss(probs_TE, counts_E)
        self.router_z = router_z_loss(logits_TE) if self.cfg.z_loss_coef > 0 else None
        if self.training:
            with torch.no_grad():
                self.load_since_update += counts_E.to(self.load_since_update.dtype)
        return out_TD.reshape(shape)

    @torch.no_grad()
    def update_expert_bias(self, all_reduce: Callable[[Tensor], object] | None = None) -> None:
        """Aux-loss-free step: bias_e += rate · sign(mean load − load_e), then reset the loads.

        `all_reduce`, when given, sums the load vector in place across data-parallel ranks first
        (e.g. `torch.distributed.all_reduce`) so every rank applies the same update. Does nothing
        unless `load_balance == "aux_free"` (the loads are still reset).
        """
        loads = self.load_since_update.clone()
        self.load_since_update.zero_()
        if self.cfg.load_balance != "aux_free":
            return
        if all_reduce is not None:
            all_reduce(loads)
        if loads.sum() == 0:
            return
        self.expert_bias += self.cfg.bias_update_rate * torch.sign(loads.mean() - loads)
