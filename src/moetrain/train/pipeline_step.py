"""The pipeline-parallel part of a training step: the step's microbatches through torch's schedule, exactly.

Every rank of a pipeline reads the same microbatches (the data loader is keyed by the data-parallel
coordinate only), so each stage knows every microbatch's targets. That is how the token counts reach
the last stage before its loss is scaled: the trainer counts the step's valid targets over the
data-parallel ranks before the schedule runs (`count_global_tokens`), and the last stage's loss
function divides each microbatch's summed token loss by that count. Gradients are then the whole
global batch's with plain SUM reductions, as without pipelining (`moetrain.train.loss`).

Under tensor and context parallelism (`SequenceSplit`) each stage is split as a whole model is: the
first stage takes the rank's CP slice of the tokens, the hidden states between stages are the rank's
sequence-parallel slice ([B, S / (cp x tp), d], torch's stages send and receive only that), each
stage's attention plan is built from the whole rows' document ids (a keyword every stage receives),
and the last stage's loss is the vocabulary-parallel cross-entropy on its CP slice of the targets, the
schedule running inside `loss_parallel` so that the loss's backward is too. Each TP rank then holds
the whole loss of its slice (counted once in the totals), the router terms of the tokens it routes.

The MoE router losses are computed where their layers are. Each stage part gets its microbatch's
targets as a keyword (popped before the part's forward) and, after the forward, its own layers'
balance and z-loss terms for that microbatch (`router_loss_terms`, the same token weighting as
without pipelining). `AddLossGradient` ties them to the stage's output: identity forward, and in
backward it also gives the terms a gradient of 1, so they backpropagate into the router with the
stage's own backward, whichever schedule orders it. Under the global-batch balance loss the step's
expert counts are measured first by a routing pass through the stages (`route_step`), summed over
the ranks that hold the same stages (data-parallel, context and tensor ranks: `stage_all_reduce`);
the aux-free bias sums its loads over the same ranks.

Multi-token prediction (`model.mtp_depth`, docs/design/mtp.md) runs in the last stage, whose part holds the
MTP modules and a copy of the first stage's token embedding (`mtp_embeddings`) for the tokens ahead: the
part gets the ids of the tokens ahead of its positions (from the whole rows, cut to the rank's CP slice) as a
keyword and `mtp=True`, and its MTP loss term (the step's MTP targets
counted over the data-parallel ranks first, like the main loss's) is tied to its output as the router
terms are. After the schedule the copy's gradient is summed into the first stage's (a reduce over the two
ranks) and dropped, so only the first stage's embedding is stepped and clipped; after the optimizer step
the first stage's weights are broadcast to the copy (`after_optimizer_step`), which so stays equal.

Gradient sync: torch's stages run every microbatch's backward without FSDP's reduction and reduce
once after the schedule's last backward (`PipelineStage.perform_reduce_grad`): one reduce-scatter
and, under HSDP, one replicate all-reduce per FSDP parameter group per step, whatever the schedule.

This module runs the pipeline; the trainer owns the optimizer, clipping and the step's record.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from moetrain.config.job import JobConfig
from moetrain.config.model import ModelConfig
from moetrain.config.parallel import ParallelConfig
from moetrain.data.packing import IGNORE_INDEX, Batch
from moetrain.dtypes import DTYPES
from moetrain.model.mtp import tokens_ahead
from moetrain.model.transformer import Transformer
from moetrain.parallel.collectives import collective_device
from moetrain.parallel.context_parallel import SequenceSplit
from moetrain.parallel.mesh import JobMesh
from moetrain.parallel.pipeline import PipelineModel, build_schedule, stage_rank
from moetrain.train.loss import mtp_loss_term, mtp_valid_counts, router_loss_terms, token_loss_sum


class AddLossGradient(torch.autograd.Function):
    """Returns a copy of `output`; its backward also backpropagates `loss` with a gradient of 1.

    A copy, not a view: torch's split backward (ZBVZeroBubble) detaches stage outputs in place.
    """

    @staticmethod
    def forward(ctx, output: Tensor, loss: Tensor) -> Tensor:
        ctx.loss_meta = (loss.shape, loss.dtype, loss.device)
        return output.clone()

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor, Tensor]:
        shape, dtype, device = ctx.loss_meta
        return grad_output, torch.ones(shape, dtype=dtype, device=device)


@dataclass
class PipelineTotals:
    """This rank's share of the step's sums: token loss (last stage), router terms (its own layers)."""

    loss_sum: float = 0.0
    balance_loss: float = 0.0
    z_loss: float = 0.0
    losses: list[Tensor] = field(default_factory=list)
    mtp_loss: float = 0.0  # (1/D) Σ_k CE_k of the last stage's microbatches
    mtp_counts: list[int] | None = None  # the step's valid targets per MTP depth; None without the MTP loss


class PipelineStep:
    """Runs a step's microbatches through this rank's stages; `model` is what the trainer steps and saves."""

    def __init__(self, cfg: JobConfig, job: JobMesh, pipeline: PipelineModel):
        self.cfg, self.job, self.pipeline = cfg, job, pipeline
        self.split = SequenceSplit.of(job)
        self.model: Transformer = pipeline.model
        self.aux_is_share = cfg.model.moe.aux_loss_scope == "global_batch"
        self.global_tokens = 0
        self.totals = PipelineTotals()
        self._targets: Tensor | None = None
        self._document_ids: Tensor | None = None
        self.mtp_weight = cfg.train.mtp_loss_weight if cfg.model.mtp_depth > 0 else 0.0
        # (group, the first stage's global rank) on the ranks holding the embedding and its copy, else None.
        self._embedding_copies = _embedding_copies(job, cfg.parallel) if cfg.model.mtp_depth > 0 else None
        for part in pipeline.parts:
            part.register_forward_pre_hook(self._stage_inputs, with_kwargs=True)
            part.register_forward_hook(self._add_router_losses)
        self.schedule = build_schedule(pipeline, job, cfg.parallel, cfg.train.grad_accum, self._loss,
                                       _stage_shapes(cfg, self.split))

    @property
    def pipeline_group(self) -> dist.ProcessGroup:
        return self.job.pipeline.get_group()

    def stage_all_reduce(self, tensor: Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> Tensor:
        """Reduce `tensor` in place (a sum, or `op`) over the ranks holding this rank's stages: its data-parallel,
        context and tensor ranks (each dimension in turn), the ranks whose routed tokens differ."""
        data = self.job.data
        groups = [] if data is None else [data.get_group(name) for name in data.mesh_dim_names
                                          if data.size(data.mesh_dim_names.index(name)) > 1]
        groups += [mesh.get_group() for mesh in (self.job.context, self.job.tensor) if mesh is not None]
        for group in groups:
            dist.all_reduce(tensor, op=op, group=group)
        return tensor

    def data_max(self, tensor: Tensor) -> Tensor:
        """The elementwise maximum over the ranks holding the same stages, in place (QK-clip's per-head maxima)."""
        return self.stage_all_reduce(tensor, dist.ReduceOp.MAX)

    def pipeline_max(self, tensor: Tensor) -> Tensor:
        """The elementwise maximum over the pipeline ranks, in place (the stages' QK-clip maxima, for the log)."""
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.pipeline_group)
        return tensor

    def count_global_tokens(self, microbatches: list[Batch]) -> int:
        """The step's valid targets over the data-parallel ranks (every stage sees the same microbatches, and
        the context and tensor ranks of a data coordinate count the same ones: divided back)."""
        local = torch.tensor([sum(batch.n_valid_targets for batch in microbatches)], dtype=torch.int64,
                             device=collective_device(self.pipeline_group))
        return int(self.stage_all_reduce(local).item()) // self.split.replicas

    # ---- the schedule's callbacks

    def _stage_inputs(self, part, args, kwargs):
        """The whole rows' targets are kept for the router terms; under CP the whole rows' document ids become
        the attention plan of this rank's slice."""
        self._targets = kwargs.pop("targets", None)
        mtp_ahead = kwargs.pop("mtp_ahead", None)
        self._document_ids = kwargs.get("document_ids")
        if len(part.mtp) and self.totals.mtp_counts is not None and torch.is_grad_enabled():
            kwargs.update(mtp=True, mtp_ahead=mtp_ahead)
        if self.split.context is not None and "document_ids" in kwargs:
            kwargs["attention_plan"] = self.split.attention_plan(kwargs.pop("document_ids"))
        return args, kwargs

    def _add_router_losses(self, part: Transformer, args, output: Tensor | tuple) -> Tensor:
        output, mtp_logits = output if isinstance(output, tuple) else (output, None)
        if not torch.is_grad_enabled() or self._targets is None:
            return output
        mask = self.split.routed_mask(self._targets != IGNORE_INDEX)  # the tokens this rank routes
        aux, z = part.aux_loss(), part.z_loss_sum(mask)
        balance, z_term = router_loss_terms(int(mask.sum()), self.global_tokens, aux, z, self.aux_is_share)
        term = torch.as_tensor(balance) + torch.as_tensor(z_term)
        self.totals.balance_loss += float(torch.as_tensor(balance).detach())
        self.totals.z_loss += float(torch.as_tensor(z_term).detach())
        if mtp_logits is not None:  # + λ/D Σ_k CE_k of this microbatch (moetrain.train.loss)
            mtp_term, mtp_part = mtp_loss_term(mtp_logits, self._targets, self._document_ids,
                                               self.totals.mtp_counts, self.mtp_weight, self.split)
            term = term + mtp_term
            self.totals.mtp_loss += mtp_part
        return AddLossGradient.apply(output, term) if term.requires_grad else output

    def _loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        """A microbatch's loss on the last stage: its CP slice's summed token loss (vocabulary-parallel under TP,
        every TP rank the same whole value) over the step's valid targets."""
        loss_sum = self.split.local_loss(token_loss_sum(logits, targets)[0])
        self.totals.loss_sum += float(loss_sum.detach()) / self.split.tp
        return loss_sum / max(self.global_tokens, 1)

    # ---- one step

    def run(self, microbatches: list[Batch], global_tokens: int) -> PipelineTotals:
        """Forward and backward of every microbatch through the schedule; this rank's sums."""
        self.global_tokens = global_tokens
        self.totals = PipelineTotals()
        if self.mtp_weight > 0:  # the step's valid targets of each MTP depth over the data-parallel ranks
            local = torch.tensor([mtp_valid_counts(b.targets, b.document_ids, self.cfg.model.mtp_depth)
                                  for b in microbatches], dtype=torch.int64).sum(dim=0)
            counts = self.stage_all_reduce(local.to(collective_device(self.pipeline_group)))
            self.totals.mtp_counts = [int(c) // self.split.replicas for c in counts.tolist()]
        tokens, positions, document_ids, targets = (torch.cat([getattr(b, name) for b in microbatches]) for name in
                                                    ("tokens", "positions", "document_ids", "targets"))
        shard = self.split.shard  # this CP rank's tokens of every row (all of them without CP)
        args = (shard(tokens),) if self.pipeline.holds_first else ()
        # The tokens ahead of each position, from the whole rows, cut to this CP rank's positions (model.mtp).
        mtp = {"mtp_ahead": shard(tokens_ahead(tokens, self.cfg.model.mtp_depth))} if self.totals.mtp_counts else {}
        losses: list[Tensor] = []
        with self.split.loss_context():  # the last stage's loss and its backward, inside the schedule
            self.schedule.step(*args, target=shard(targets), losses=losses, positions=shard(positions),
                               document_ids=document_ids, targets=targets, **mtp)
        self._targets = self._document_ids = None
        self._sum_embedding_gradients()
        return self.totals

    def _sum_embedding_gradients(self) -> None:
        """The last stage's gradient of its embedding copy summed into the first stage's, then dropped there."""
        if self._embedding_copies is None:
            return
        group, owner = self._embedding_copies
        weight = self.model.tok_embeddings.weight
        grad = _local(weight.grad) if weight.grad is not None else torch.zeros_like(_local(weight))
        dist.reduce(grad, dst=owner, group=group)
        if self.job.rank != owner:
            weight.grad = None

    @torch.no_grad()
    def after_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Give the last stage's embedding copy the first stage's new weights (collective over the two ranks).

        The copy keeps no optimizer state of its own: a checkpoint load's initialisation may have given it one,
        which would go stale and could be the copy a later save keeps."""
        if self._embedding_copies is None:
            return
        group, owner = self._embedding_copies
        weight = self.model.tok_embeddings.weight
        dist.broadcast(_local(weight), src=owner, group=group)
        if self.job.rank != owner:
            optimizer.state.pop(weight, None)

    @torch.no_grad()
    def forward_only(self, batch: Batch, after_stage: Callable[[Transformer], None] | None = None) -> Tensor | None:
        """`batch` through every stage in order without autograd: the logits on the rank holding the last stage,
        None on the others (collective over the pipeline group). `after_stage(part)` runs after each of this
        rank's stages. Hidden states move between pipeline ranks by send/recv, so any batch shape works.
        Under CP / TP the logits are the rank's CP slice's (split over the vocabulary under TP)."""
        pipeline, group, parallel = self.pipeline, self.pipeline_group, self.cfg.parallel
        by_stage = dict(zip(pipeline.stage_ids, pipeline.parts, strict=True))
        me = self.job.pipeline.get_local_rank()
        inputs = self.split.model_inputs(batch)
        tokens = inputs.pop("tokens")
        hidden = None
        for stage in range(pipeline.n_stages):
            holder, previous = stage_rank(stage, parallel), stage_rank(stage - 1, parallel) if stage else None
            if stage not in by_stage:
                if previous == me:
                    dist.send(hidden.contiguous(), dst=dist.get_global_rank(group, holder), group=group)
                continue
            if previous is not None and previous != me:
                rows, seq = batch.tokens.shape
                hidden = torch.empty(rows, self.split.local_len(seq), self.cfg.model.dim,
                                     dtype=_hidden_dtype(self.cfg), device=self.job.device)
                dist.recv(hidden, src=dist.get_global_rank(group, previous), group=group)
            part = by_stage[stage]
            hidden = part(tokens if stage == 0 else hidden, **inputs)
            if after_stage is not None:
                after_stage(part)
        return hidden if pipeline.holds_last else None

    @torch.no_grad()
    def route_step(self, microbatches: list[Batch]) -> None:
        """Under the global-batch balance loss: the step's expert counts per MoE layer, before the step trains.

        Each microbatch goes through the stages (`forward_only`, the parts in eval mode: no aux-free loads
        recorded); each rank sums its layers' counts over the ranks holding its stages (each routed its own
        tokens) and gives them to its layers.
        """
        if not _uses_global_balance(self.cfg.model):
            return
        counts: dict[int, Tensor] = {}

        def count(part: Transformer) -> None:
            for layer in part.moe_layers():
                counts[id(layer)] = counts.get(id(layer), 0) + layer.tokens_per_expert.to(torch.float64)

        self.model.eval()
        try:
            for batch in microbatches:
                self.forward_only(batch, count)
        finally:
            self.model.train()
        layers = self.model.moe_layers()
        if not layers:  # stages of dense layers only (as all ranks holding them): they pass hidden states on
            return
        n_tokens = float(sum(batch.tokens.numel() for batch in microbatches)) / self.split.replicas  # routed here
        flat = torch.cat([counts[id(layer)] for layer in layers] + [torch.tensor([n_tokens], dtype=torch.float64)])
        flat = self.stage_all_reduce(flat.to(collective_device(self.pipeline_group))).cpu()
        self.model.set_global_balance(flat[:-1].view(len(layers), -1), int(flat[-1]))


def _uses_global_balance(model: ModelConfig) -> bool:
    """Whether the step measures its expert counts first: from the config, not a rank's own layers, as every
    pipeline rank takes part in the routing pass, one whose stages hold dense layers only too."""
    moe = model.moe
    return (model.n_dense_layers < model.n_layers and moe.load_balance == "aux_loss"
            and moe.aux_loss_scope == "global_batch" and moe.aux_loss_coef > 0)


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _embedding_copies(job: JobMesh, parallel: ParallelConfig) -> tuple[dist.ProcessGroup, int] | None:
    """(the group of this rank and the rank holding the other copy of the token embedding, the global rank of
    the first stage's holder) on the ranks of the first and the last stage, None on the others. Collective."""
    first, last = stage_rank(0, parallel), stage_rank(parallel.pp_stages - 1, parallel)
    ranks = job.root.mesh.reshape(parallel.pp, -1)  # pp is the root's outermost dimension
    column = int((ranks == job.rank).nonzero()[0, 1])
    if parallel.pp == 2:
        group = job.pipeline.get_group()
    else:  # every rank creates every pair's group, in the same order
        group, _ = dist.new_subgroups_by_enumeration([[int(ranks[first, c]), int(ranks[last, c])]
                                                      for c in range(ranks.shape[1])])
    return (group, int(ranks[first, column])) if job.pipeline.get_local_rank() in (first, last) else None


def _hidden_shape(cfg: JobConfig) -> tuple[int, int, int]:
    return cfg.train.microbatch_size, cfg.data.seq_len, cfg.model.dim


def _hidden_dtype(cfg: JobConfig) -> torch.dtype:
    parallel = cfg.parallel
    return DTYPES[parallel.output_dtype or parallel.param_dtype]


def _stage_shapes(cfg: JobConfig, split: SequenceSplit) -> tuple[Tensor, Tensor, Tensor]:
    """Meta tensors of a microbatch's tokens (the rank's CP slice), a stage's hidden states (its CP x TP slice)
    and the logits (the CP slice's; under TP a DTensor of that shape, split over the vocabulary): torch's
    stages then need no inference pass (a real forward that would count an extra microbatch's expert loads)."""
    batch, seq, dim = cfg.train.microbatch_size, cfg.data.seq_len, cfg.model.dim
    dtype = _hidden_dtype(cfg)
    # Hidden states and logits carry gradients: a stage's received input must require grad for its backward.
    return (torch.empty(batch, seq // split.cp, dtype=torch.int64, device="meta"),
            torch.empty(batch, split.local_len(seq), dim, dtype=dtype, device="meta", requires_grad=True),
            torch.empty(batch, seq // split.cp, cfg.model.vocab_size, dtype=dtype, device="meta", requires_grad=True))
