"""Context parallelism and the sequence split: which tokens of a microbatch each rank computes.

Under context parallelism (`parallel.cp`) every rank of a CP group holds the same microbatches and
computes a part of every sequence: the rows are cut into 2 x cp chunks and rank r takes chunks r and
2 x cp - 1 - r (head-tail load balancing: under a causal mask late chunks cost more, so every rank
gets one early and one late chunk and the same causal work). Each layer's attention then runs the tiled
attention of moetrain.model.tiled_attention (`ContextAttention`): the keys and values of the whole rows are
all-gathered over the CP group (functional collectives, sequence-first; gathered again in backward instead
of saved, their gradients reduce-scattered), and the rank's queries attend to them tile by tile with an
online softmax, each tile skipped, unmasked or masked from the whole rows' document ids and token indices,
so packed documents never see each other, across the split too; sliding windows and attention sinks are
part of the same kernel. No [queries x whole row] mask or score matrix exists: memory is linear in the
rank's tokens. Every `model.attention` method runs this way under CP: the keys of a rank's queries live on
other ranks, so the method-specific layouts do not apply. torch's `context_parallel` API was not used: its
ring attention serves plain causal SDPA only, without document masks, windows or sinks.

`SequenceSplit` is what a training loop needs of both CP and tensor parallelism: the rank's model
inputs (the CP slice and the attention plan over the whole rows), its targets, the mask of the tokens
its MoE layers route (TP's sequence parallelism cuts the CP slice once more), how many ranks hold
the same microbatches (their token counts and losses must not be summed twice), and for multi-token
prediction the tokens ahead of the rank's positions, read from the whole rows before the cut. This module neither
changes a model's layers (moetrain.parallel.tensor_parallel) nor computes losses.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed._functional_collectives import all_gather_single, reduce_scatter_single, wait_tensor
from torch.distributed.device_mesh import DeviceMesh

from moetrain.data.packing import Batch
from moetrain.model.attention import AttentionPlan, masked_max_logit_per_head
from moetrain.model.mtp import tokens_ahead
from moetrain.model.tiled_attention import KeyValueExchange, TiledAttention, TilePlan, plan_tiles
from moetrain.parallel.mesh import JobMesh
from moetrain.parallel.tensor_parallel import local_loss, vocab_parallel_loss


def head_tail_indices(seq: int, cp: int, rank: int, device: torch.device | str = "cpu") -> Tensor:
    """Token indices [seq / cp] of CP rank `rank`: chunks `rank` and 2 cp - 1 - rank of 2 cp equal chunks."""
    if seq % (2 * cp):
        raise ValueError(f"sequence length {seq} is not divisible by 2 x cp = {2 * cp}")
    chunk = seq // (2 * cp)
    starts = (rank * chunk, (2 * cp - 1 - rank) * chunk)
    return torch.cat([torch.arange(start, start + chunk, device=device) for start in starts])


@dataclass
class ContextAttention:
    """Attention from this rank's queries to the keys of the whole rows, tile by tile (model.tiled_attention)."""

    group: DeviceMesh
    document_ids: Tensor  # [B, S]: the whole rows
    query_index: Tensor  # [S / cp]: this rank's tokens
    key_index: Tensor  # [S]: the token index of each gathered key (ranks in order, each its own indices)

    def __post_init__(self) -> None:
        self.plans: dict[tuple, TilePlan] = {}
        group = self.group.get_group()
        # Dimension 0 (the sequence) of [S / cp, B, F]: the functional collectives gather and scatter along it.
        self.exchange = KeyValueExchange(lambda t: wait_tensor(all_gather_single(t, 0, group)),
                                         lambda t: wait_tensor(reduce_scatter_single(t, "sum", 0, group)))

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, window: int | None) -> Tensor:
        # One plan per forward and window (and head count), shared by the layers.
        key = (window, q.shape[0] * q.shape[2])
        if key not in self.plans:
            self.plans[key] = plan_tiles(self.query_index, self.key_index, self.document_ids, window, key[1])
        return TiledAttention.apply(q, k, v, sinks, self.plans[key], self.exchange)

    @torch.no_grad()
    def max_logit_per_head(self, q: Tensor, k: Tensor, window: int | None) -> Tensor:
        """[H]: each of the rank's query heads' largest logit over the keys of the whole rows its queries may see
        (QK-clip's record): the keys gathered over the CP group, masked by document, causality and window."""
        batch, local, groups, head_dim = k.shape
        keys = self.exchange.gather(k.reshape(batch, local, -1).transpose(0, 1).contiguous())  # [S, B, G·D]
        keys = keys.transpose(0, 1).reshape(batch, -1, groups, head_dim)  # the ranks' tokens in key_index order
        queries, keys_at = self.query_index.view(-1, 1), self.key_index.view(1, -1)
        allowed = keys_at <= queries
        if window is not None:
            allowed = allowed & (queries - keys_at < window)
        documents = self.document_ids
        same_document = documents[:, self.query_index].unsqueeze(-1) == documents[:, self.key_index].unsqueeze(-2)
        return masked_max_logit_per_head(q, keys, (allowed & same_document).unsqueeze(1))


@dataclass(frozen=True)
class SequenceSplit:
    """This rank's share of every microbatch under context (`context`) and tensor (`tensor`) parallelism."""

    context: DeviceMesh | None = None
    tensor: DeviceMesh | None = None

    @classmethod
    def of(cls, job: JobMesh) -> SequenceSplit:
        return cls(job.context, job.tensor)

    @property
    def cp(self) -> int:
        return 1 if self.context is None else self.context.size()

    @property
    def tp(self) -> int:
        return 1 if self.tensor is None else self.tensor.size()

    @property
    def replicas(self) -> int:
        """Ranks holding the same microbatches (cp x tp): counts every one of them makes are summed this often."""
        return self.cp * self.tp

    def _query_index(self, seq: int, device: torch.device) -> Tensor:
        return head_tail_indices(seq, self.cp, self.context.get_local_rank(), device)

    def shard(self, tensor: Tensor) -> Tensor:
        """This CP rank's tokens of a [B, S, ...] tensor (the whole tensor without CP)."""
        if self.context is None:
            return tensor
        return tensor.index_select(1, self._query_index(tensor.shape[1], tensor.device))

    def model_inputs(self, batch: Batch, mtp_depth: int = 0) -> dict:
        """Keyword arguments of the model's forward for this rank's share of `batch`; with `mtp_depth` > 0 also
        the multi-token-prediction forward's (`mtp=True` and the tokens ahead of the rank's positions, taken
        from the whole rows before the CP cut: a slice's last tokens look ahead into other ranks' chunks)."""
        mtp = {"mtp": True, "mtp_ahead": self.shard(tokens_ahead(batch.tokens, mtp_depth))} if mtp_depth else {}
        if self.context is None:
            return {"tokens": batch.tokens, "positions": batch.positions, "document_ids": batch.document_ids, **mtp}
        return {"tokens": self.shard(batch.tokens), "positions": self.shard(batch.positions),
                "attention_plan": self.attention_plan(batch.document_ids), **mtp}

    def attention_plan(self, document_ids: Tensor) -> AttentionPlan:
        """Under CP: the plan of this rank's queries over the keys of the whole rows `document_ids` [B, S]."""
        seq, device = document_ids.shape[1], document_ids.device
        key_index = torch.cat([head_tail_indices(seq, self.cp, r, device) for r in range(self.cp)])
        attention = ContextAttention(self.context, document_ids, self._query_index(seq, device), key_index)
        return AttentionPlan("context", external=attention)

    def local_len(self, seq: int) -> int:
        """Tokens of a `seq`-long row in this rank's hidden states between blocks (CP's slice, then TP's)."""
        return seq // self.replicas

    def routed_mask(self, mask: Tensor) -> Tensor:
        """The entries of a [B, S] token mask for the tokens this rank's MoE layers route: the CP slice,
        then under TP the rank's contiguous part of it (sequence parallelism's Shard(1))."""
        mask = self.shard(mask)
        if self.tensor is None:
            return mask
        return mask.chunk(self.tp, dim=1)[self.tensor.get_local_rank()]

    def loss_context(self) -> AbstractContextManager:
        """Where the language-model loss and its backward run (TP's vocabulary-parallel cross-entropy)."""
        return vocab_parallel_loss(self.tensor is not None)

    @staticmethod
    def local_loss(loss: Tensor) -> Tensor:
        return local_loss(loss)
