"""The step-level half of the global-batch balance loss: the step's expert counts, before the step trains.

Under `model.moe.aux_loss_scope = "global_batch"` the balance loss E · Σ_e f_e · P_e takes f_e over
every assignment of the whole step (all microbatches, all data-parallel ranks). Microbatch m's
backward needs the final f, but runs before the later microbatches' forwards. Since the loss is
linear in the router probabilities once f is fixed, it splits exactly into per-microbatch terms
(`moetrain.model.routing.global_balance_share`) as soon as f is known. So each step first runs a
no-grad routing pass over its microbatches (up to the last MoE block, no LM head) to count the
assignments, sums the counts over the data-parallel ranks (one all-reduce of n_moe_layers × E + 1
numbers), and hands them to the model; the forwards and backwards that follow are exact. The cost,
about one forward per step, is measured in docs/models.md. A step of one microbatch on one rank
skips the pass: its counts are those its own forward makes, so each MoE layer takes them there
(`balance_on_own_counts`), the same numbers without the extra forward.

This module only orchestrates: the loss itself is the model's (routing.py), and the trainer calls
`prepare_global_balance` once per step before its accumulation loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from moetrain.data.packing import Batch
from moetrain.parallel.collectives import all_reduce_sum, collective_device, rank_and_world


@torch.no_grad()
def prepare_global_balance(model: nn.Module, microbatches: Sequence[Batch],
                           inputs: Callable[[Batch], dict] | None = None, token_split: int = 1) -> None:
    """Count the step's expert assignments over all microbatches and ranks and give them to the model.

    A no-op unless the model uses the global-batch balance loss. Collective when it does: every
    rank must call it with its own microbatches. `inputs` gives the forward's keyword arguments of a
    microbatch (context parallelism's slice of it; default: the whole microbatch); `token_split` ranks
    route disjoint parts of those inputs' tokens (tensor parallelism's sequence split).
    """
    if not model.needs_global_balance():
        return
    if len(microbatches) == 1 and rank_and_world()[1] == 1:
        model.balance_on_own_counts()
        return
    was_training = model.training
    model.eval()  # routing only: no load bookkeeping for the aux-free bias, no graph
    counts = None
    n_tokens = 0
    try:
        for batch in microbatches:
            kwargs = inputs(batch) if inputs is not None else {
                "tokens": batch.tokens, "positions": batch.positions, "document_ids": batch.document_ids}
            model(**kwargs, until_last_moe=True)
            load = model.tokens_per_expert().to(torch.float64)
            counts = load if counts is None else counts + load
            n_tokens += kwargs["tokens"].numel() // token_split
    finally:
        model.train(was_training)
    totals = torch.cat([counts.flatten(), torch.tensor([float(n_tokens)], dtype=torch.float64, device=counts.device)])
    totals = all_reduce_sum(totals.to(collective_device())).cpu()
    model.set_global_balance(totals[:-1].view(counts.shape), int(totals[-1]))
