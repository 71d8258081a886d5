"""Token-weighted language-model loss for exact gradient accumulation.

The step objective is Σ(token losses over every rank and microbatch) / N_global,
where N_global counts valid targets (targets != ignore_index) over the whole step
(`moetrain.parallel.grad_sync.count_global_tokens`). Each microbatch contributes
its summed token loss divided by N_global, so the sum of microbatch gradients over
ranks (collectives SUM, no averaging) is exactly the global-batch gradient whatever
the token counts are. This module computes losses; it must not communicate.
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


def microbatch_loss(
    loss_sum: torch.Tensor,
    n_valid: int,
    global_tokens: int,
    aux_loss: torch.Tensor | float = 0.0,
) -> torch.Tensor:
    """The quantity to backward for one microbatch.

    (loss_sum + n_valid · aux_loss) / global_tokens. The MoE auxiliary loss (already
    multiplied by its coefficient, computed over this forward's tokens) is weighted by
    the microbatch's share of the step's valid tokens, so the step's total aux term is
    the token-weighted mean of per-microbatch aux losses: a microbatch with few tokens
    pushes the router as little as it pushes the LM loss, one with no valid tokens not
    at all. `global_tokens = 0` (a step with no valid target anywhere) gives an exact
    0 loss instead of 0/0.
    """
    denominator = max(int(global_tokens), 1)
    return (loss_sum + n_valid * aux_loss) / denominator
