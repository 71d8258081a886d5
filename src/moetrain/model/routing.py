"""Choosing experts: router scores to top-k, the `Routing` record, token rounding, router losses.

The MoE layer (moe.py) turns router logits into a choice with `select_experts` (score function,
top-k on the scores plus an optional choice-only bias, gate values optionally renormalised),
groups that choice by expert with `routing_from_topk`, optionally rounds every expert's token
count to a multiple of a GEMM tile with `round_routing`, and measures imbalance with
`switch_aux_loss` (one microbatch) or `global_balance_share` (one microbatch's exact part of the
balance loss of a whole step, given the step's expert shares), and router logit growth with
`router_z_loss`. The expert computation (experts.py) consumes a `Routing`.

Everything here is a pure function of tensors: no parameters, no module state, no GEMMs and no
distributed code, and it imports no other model module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from moetrain.errors import ModelError


@dataclass
class Routing:
    """Which token each routed assignment belongs to, grouped by expert (expert 0's first).

    token_index: LongTensor[N], token of each assignment; scores: Tensor[N], its gate weight
    (differentiable: the router gradient flows through it); counts: LongTensor[E], assignments per
    expert (sums to N), so expert e owns rows counts[:e].sum() ... counts[:e+1].sum() of N.
    """

    token_index: Tensor
    scores: Tensor
    counts: Tensor

    @property
    def n_experts(self) -> int:
        return int(self.counts.numel())

    @property
    def n_assignments(self) -> int:
        return int(self.token_index.numel())


def select_experts(logits: Tensor, score_func: str, top_k: int, renormalize: bool,
                   choice_bias: Tensor | None = None, n_group: int = 1, topk_group: int = 1,
                   scaling: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    """Router logits [T, E] -> (probs [T, E] rows summing to 1, topk_idx [T, k], gates [T, k]).

    Scores are softmax or sigmoid of the logits in at least float32 (`score_func` "softmax" or
    "sigmoid"; sigmoid probs are the scores normalised per token). The top-k experts of each token
    are chosen on scores + `choice_bias` [E] (aux-loss-free balancing, DeepSeek-V3's correction
    bias; None: on the scores), and the bias only affects the choice, never the gate values. With
    `n_group` > 1 the choice is group-limited (DeepSeek-V3): the E experts form n_group groups of
    consecutive experts, each scored by the sum of its two highest choice scores, and only the
    experts of a token's `topk_group` best groups can be chosen. Gates are the chosen scores,
    divided by their sum (+ 1e-20) when `renormalize`, then multiplied by `scaling`
    (routed_scaling_factor).
    """
    logits_TE = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if score_func == "softmax":
        scores_TE = logits_TE.softmax(dim=-1)
        probs_TE = scores_TE
    else:
        scores_TE = logits_TE.sigmoid()
        probs_TE = scores_TE / scores_TE.sum(dim=-1, keepdim=True)
    choice_TE = scores_TE + choice_bias if choice_bias is not None else scores_TE
    if n_group > 1:
        choice_TE = choice_TE.masked_fill(~group_mask(choice_TE, n_group, topk_group), float("-inf"))
    topk_idx_TK = choice_TE.topk(top_k, dim=-1).indices
    gates_TK = scores_TE.gather(-1, topk_idx_TK)
    if renormalize:
        gates_TK = gates_TK / (gates_TK.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling != 1.0:
        gates_TK = gates_TK * scaling
    return probs_TE, topk_idx_TK, gates_TK


def group_mask(choice: Tensor, n_group: int, topk_group: int) -> Tensor:
    """Bool [T, E]: the experts inside each token's `topk_group` best groups (of `n_group` equal groups of
    consecutive experts), a group scored by the sum of its top-2 `choice` [T, E] scores."""
    n_tokens, n_experts = choice.shape
    if n_experts % n_group or n_experts // n_group < 2 or not 1 <= topk_group <= n_group:
        raise ModelError(f"group-limited routing needs n_group = {n_group} dividing {n_experts} experts into groups "
                         f"of >= 2 and 1 <= topk_group = {topk_group} <= n_group")
    group_scores_TG = choice.view(n_tokens, n_group, -1).topk(2, dim=-1).values.sum(dim=-1)
    chosen_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool)
    chosen_TG.scatter_(1, group_scores_TG.topk(topk_group, dim=-1).indices, True)
    return chosen_TG.repeat_interleave(n_experts // n_group, dim=1)


def routing_from_topk(topk_idx: Tensor, topk_scores: Tensor, n_experts: int) -> Routing:
    """Group the (token, expert) choices of a top-k router by expert; within an expert, by token."""
    if topk_idx.dim() != 2 or topk_idx.shape != topk_scores.shape:
        raise ValueError(f"topk_idx {tuple(topk_idx.shape)} and topk_scores {tuple(topk_scores.shape)} "
                         "must both be [tokens, top_k]")
    # The friendly range check reads values on the host; on an accelerator that would stall the
    # stream every layer, so there an out-of-range index fails in the counting kernel instead; so it
    # does in a compiled graph (topk indices are in range by construction there).
    host_check = topk_idx.device.type == "cpu" and not torch.compiler.is_compiling()
    if host_check and topk_idx.numel() and (int(topk_idx.min()) < 0 or int(topk_idx.max()) >= n_experts):
        raise ValueError(f"expert indices must lie in [0, {n_experts}); got range "
                         f"[{int(topk_idx.min())}, {int(topk_idx.max())}]")
    top_k = topk_idx.shape[1]
    expert_N = topk_idx.reshape(-1)  # N = tokens * top_k assignments, flat index = token * k + slot
    # Stable sort keeps assignments of one expert in token order.
    order_N = torch.argsort(expert_N, stable=True)
    # index_add_ into a fixed-size count vector (unlike bincount, no host sync to size the output).
    counts_E = torch.zeros(n_experts, dtype=torch.long, device=topk_idx.device)
    counts_E.index_add_(0, expert_N, torch.ones_like(expert_N))
    return Routing(
        token_index=torch.div(order_N, top_k, rounding_mode="floor"),
        scores=topk_scores.reshape(-1)[order_N],
        counts=counts_E,
    )


def round_routing(router_probs: Tensor, routing: Routing, tile: int) -> tuple[Routing, int]:
    """Round every expert's assignment count to a multiple of `tile`; return (routing, decisions changed).

    For an expert with count c and remainder r = c mod tile, either drop its r lowest-score
    assignments or fill it with the (tile - r) highest-probability tokens not already routed to it,
    whichever changes fewer decisions (ties drop: less compute; fill only when enough tokens exist).
    Filled assignments take router_probs[t, e] as their gate weight, so they stay differentiable.
    """
    if not isinstance(tile, int) or tile < 1:
        raise ModelError(f"token_rounding_tile = {tile!r} is invalid: must be an integer >= 1")
    n_tokens, n_experts = router_probs.shape
    if n_experts != routing.n_experts:
        raise ValueError(f"router_probs has {n_experts} experts, routing has {routing.n_experts}")
    if tile == 1:
        return routing, 0
    sizes = routing.counts.tolist()
    probs_detached_TE = router_probs.detach()
    tokens_out, scores_out, counts_out = [], [], []
    changed = 0
    for e, (tokens, scores) in enumerate(zip(routing.token_index.split(sizes), routing.scores.split(sizes),
                                             strict=True)):
        count = sizes[e]
        remainder = count % tile
        fill = tile - remainder
        if remainder == 0:
            tokens_out.append(tokens)
            scores_out.append(scores)
        elif remainder <= fill or count + fill > n_tokens:
            # Drop the `remainder` lowest-score assignments; keep the rest in token order.
            keep = torch.topk(scores.detach(), count - remainder).indices.sort().values
            tokens_out.append(tokens[keep])
            scores_out.append(scores[keep])
            changed += remainder
        else:
            candidate_T = probs_detached_TE[:, e].clone()
            candidate_T[tokens] = float("-inf")
            new_tokens = torch.topk(candidate_T, fill).indices
            merged = torch.cat([tokens, new_tokens])
            merged_scores = torch.cat([scores, router_probs[new_tokens, e].to(scores.dtype)])
            order = torch.argsort(merged, stable=True)
            tokens_out.append(merged[order])
            scores_out.append(merged_scores[order])
            changed += fill
        counts_out.append(tokens_out[-1].numel())
    rounded = Routing(
        token_index=torch.cat(tokens_out) if tokens_out else routing.token_index,
        scores=torch.cat(scores_out) if scores_out else routing.scores,
        counts=torch.tensor(counts_out, dtype=routing.counts.dtype, device=routing.counts.device),
    )
    return rounded, changed


def switch_aux_loss(probs: Tensor, counts: Tensor, top_k: int) -> Tensor:
    """Switch-Transformer load-balancing loss E · Σ_e f_e · P_e (1 when perfectly balanced).

    f_e = share of the T·k assignments that went to expert e (no gradient), P_e = mean router
    probability of e over the T tokens (probs rows sum to 1).
    """
    n_tokens, n_experts = probs.shape
    fraction_E = counts.to(probs.dtype) / max(n_tokens * top_k, 1)
    return n_experts * (fraction_E * probs.mean(dim=0)).sum()


def balance_fractions(counts: Tensor, n_tokens: int | Tensor, top_k: int) -> Tensor:
    """f_e: each expert's share of the n_tokens · top_k routed assignments counted in `counts` [..., E]."""
    return counts.to(torch.float64) / max(float(n_tokens) * top_k, 1.0)


def global_balance_share(probs: Tensor, fraction: Tensor, n_tokens_global: int | Tensor) -> Tensor:
    """This microbatch's exact part of a whole step's balance loss E · Σ_e f_e · P_e.

    The step's loss has f_e = `fraction` [E] (shares of all the step's assignments, every
    microbatch and rank; no gradient) and P_e = mean probability of e over all n_tokens_global
    routed tokens, so it is linear in the probabilities: it splits exactly into per-microbatch
    terms E · Σ_e f_e · Σ_{t in microbatch} p_te / n_tokens_global, whose sum over microbatches and
    ranks (and whose gradients, summed the same way) equal the whole-batch loss and gradient
    however the batch is split. probs [T, E] are this microbatch's router probabilities.
    """
    n_experts = probs.shape[-1]
    fraction_E = fraction.detach().to(probs.dtype)
    return n_experts * (fraction_E * probs.sum(dim=0)).sum() / max(float(n_tokens_global), 1.0)


def router_z_loss(logits: Tensor) -> Tensor:
    """Per-token router z-loss logsumexp_e(logits_te)^2 (ST-MoE, arXiv 2202.08906, eq. 5), shape [T].

    Computed in at least float32. The caller sums it over the tokens it counts and divides by the
    step's token count, like the language-model loss, so accumulation stays exact.
    """
    logits_TE = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.logsumexp(logits_TE, dim=-1).square()
