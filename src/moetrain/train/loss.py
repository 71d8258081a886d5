"""Token-weighted language-model loss for exact gradient accumulation.

The step objective is Σ(token losses over every rank and microbatch) / N_global (+ the MoE
router losses, `router_loss_terms`),
where N_global counts valid targets (targets != ignore_index) over the whole step
(`moetrain.parallel.grad_sync.count_global_tokens`). Each microbatch contributes
its summed token loss divided by N_global, so the sum of microbatch gradients over
ranks (collectives SUM, no averaging) is exactly the global-batch gradient whatever
the token counts are.

Multi-token prediction (model.mtp_depth = D, weight λ = train.mtp_loss_weight) adds λ/D · Σ_k CE_k,
each CE_k token-weighted over the step's valid depth-k targets (`mtp_targets`, counted over every
rank and microbatch like N_global) in the same way. This module computes losses; it must not communicate.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moetrain.data.packing import IGNORE_INDEX


def token_loss_sum(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> tuple[torch.Tensor, int]:
    """(sum of per-token cross-entropy over valid targets, number of valid targets).

    The sum is computed in float32 at least (bf16 logits are upcast) so that summing
    thousands of token losses does not lose the small ones. With no valid target the
    sum is an exact 0 that still carries a graph (so backward runs on every rank
    and FSDP's collectives stay matched), never NaN.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree: "
                         "expected logits [..., V] and targets [...]")
    flat_logits = logits.reshape(-1, logits.shape[-1])
    if flat_logits.dtype in (torch.bfloat16, torch.float16):
        flat_logits = flat_logits.float()
    flat_targets = targets.reshape(-1)
    loss_sum = F.cross_entropy(flat_logits, flat_targets, ignore_index=ignore_index, reduction="sum")
    n_valid = int((flat_targets != ignore_index).sum().item())
    return loss_sum, n_valid


def router_loss_terms(
    n_valid: int,
    global_tokens: int,
    aux_loss: torch.Tensor | float = 0.0,
    z_loss_sum: torch.Tensor | float = 0.0,
    aux_is_share: bool = False,
) -> tuple[torch.Tensor | float, torch.Tensor | float]:
    """(balance, z): one microbatch's parts of the step objective from the MoE router losses.

    balance: the balance loss (already multiplied by its coefficient). A per-microbatch loss
    (`aux_loss_scope = "microbatch"`) is weighted by the microbatch's share n_valid / global_tokens
    of the step's valid tokens, so the step's term is the token-weighted mean of microbatch losses:
    a microbatch with few tokens pushes the router as little as it pushes the LM loss, one with no
    valid tokens not at all. A share of the step's global-batch loss (`aux_is_share`) is already in
    step units and is taken as it is. z: the z-loss summed over the microbatch's valid tokens (with
    its coefficient) over global_tokens, token-weighted exactly like the LM loss.
    """
    denominator = max(int(global_tokens), 1)
    balance = aux_loss if aux_is_share else n_valid * aux_loss / denominator
    return balance, z_loss_sum / denominator


def microbatch_loss(
    loss_sum: torch.Tensor,
    n_valid: int,
    global_tokens: int,
    aux_loss: torch.Tensor | float = 0.0,
    z_loss_sum: torch.Tensor | float = 0.0,
    aux_is_share: bool = False,
) -> torch.Tensor:
    """The quantity to backward for one microbatch.

    loss_sum / global_tokens + the router terms of `router_loss_terms`. `global_tokens = 0` (a step
    with no valid target anywhere) gives an exact 0 language-model part instead of 0/0.
    """
    balance, z = router_loss_terms(n_valid, global_tokens, aux_loss, z_loss_sum, aux_is_share)
    return loss_sum / max(int(global_tokens), 1) + balance + z


def mtp_targets(targets: torch.Tensor, document_ids: torch.Tensor, depth: int,
                ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Depth-k targets [B, S]: position i predicts token i + k + 1, the main target of position i + k.

    Kept only where that main target is kept (inside its document, under the loss mask) and
    position i is in the same document as i + k, so no MTP target crosses a document boundary of a
    packed sequence or a masked-out span of a conversation; ignore_index elsewhere and past the end.
    """
    out = torch.full_like(targets, ignore_index)
    seq = targets.shape[1]
    if depth < seq:
        same_document = document_ids[:, :seq - depth] == document_ids[:, depth:]
        out[:, :seq - depth] = torch.where(same_document, targets[:, depth:], ignore_index)
    return out


def mtp_valid_counts(targets: torch.Tensor, document_ids: torch.Tensor, mtp_depth: int) -> list[int]:
    """Valid targets of each depth 1..mtp_depth in one microbatch (summed over the step before `mtp_loss_term`)."""
    return [int((mtp_targets(targets, document_ids, k) != IGNORE_INDEX).sum()) for k in range(1, mtp_depth + 1)]


def mtp_loss_term(mtp_logits: list[torch.Tensor], targets: torch.Tensor, document_ids: torch.Tensor,
                  global_counts: list[int], weight: float, split=None) -> tuple[torch.Tensor, float]:
    """(the microbatch's part of λ/D · Σ_k CE_k, for backward; its part of the unweighted (1/D) Σ_k CE_k, to log).

    `global_counts[k - 1]` is the step's valid depth-k targets over every rank and microbatch, so the
    parts of all microbatches and ranks sum to the step's token-weighted MTP loss. `targets` and
    `document_ids` are the whole rows: the depth-k targets are made from them, then cut to this rank's
    positions by `split` (a `moetrain.parallel.context_parallel.SequenceSplit`, under context or tensor
    parallelism), whose TP ranks each hold the whole loss of their slice (the logged part is divided by tp).
    """
    depth = len(mtp_logits)
    mean_part = torch.zeros((), device=mtp_logits[0].device)
    for k, (logits, count) in enumerate(zip(mtp_logits, global_counts, strict=True), start=1):
        targets_k = mtp_targets(targets, document_ids, k)
        loss_sum, _ = token_loss_sum(logits, targets_k if split is None else split.shard(targets_k))
        mean_part = mean_part + (loss_sum if split is None else split.local_loss(loss_sum)) / max(int(count), 1)
    mean_part = mean_part / depth
    return weight * mean_part, float(mean_part.detach()) / (1 if split is None else split.tp)
