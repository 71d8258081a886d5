"""The [parallel] section: pipeline, data, context, tensor and expert parallel sizes, precision, devices; checks.

Sizes that depend on the world size are checked by `check_world_size` once the world is known;
a rule that also reads the model (parallel.ep against the experts) is JobConfig's, which calls
`check_sequence_split` for what tensor and context parallelism need of the model, data and
training sections. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moetrain.config.checks import check, check_positive
from moetrain.config.data import DataConfig
from moetrain.config.model import ModelConfig
from moetrain.config.train import TrainConfig

DType = Literal["float32", "bfloat16", "float16"]


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    """Data-parallel replicas (HSDP's replicate dimension; 1 = plain FSDP)."""
    dp_shard: int = -1
    """Ranks each replica is sharded over (FSDP2); -1 = whatever is left of the world size after dp_replicate."""
    pp: int = 1
    """Pipeline parallelism: ranks along the pipeline dimension (outermost); 1 = off."""
    pp_schedule: Literal["1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"] = "1F1B"
    """The pipeline schedule (torch.distributed.pipelining); under pp > 1 the step's train.grad_accum
    microbatches are the schedule's microbatches. Interleaved1F1B takes pp_stages_per_rank >= 2,
    ZBVZeroBubble exactly 2 (V-shaped: rank r holds stages r and 2 pp - 1 - r). DualPipeV is refused."""
    pp_stages_per_rank: int = 1
    """Pipeline stages each pipeline rank holds (pp x pp_stages_per_rank stages split the layers)."""
    tp: int = 1
    """Tensor (with sequence) parallelism: ranks that split each dense layer (innermost); 1 = off."""
    cp: int = 1
    """Context parallelism: ranks that split each sequence; 1 = off."""
    ep: int = 1
    """Expert parallelism: each MoE layer's experts are split into `ep` groups of whole experts,
    over `ep` ranks carved out of dp_shard (tokens travel to their experts by all-to-all);
    expert weights are FSDP-sharded over the dp_shard / ep ranks holding the same experts. 1 = off."""
    sync_policy: Literal["auto", "every_microbatch", "delayed_all_reduce", "final_only"] = "auto"
    """Gradient sync under accumulation; auto = delayed_all_reduce under HSDP with accumulation, else
    every_microbatch (docs/design/parallel.md)."""
    reshard_after_forward: bool = True
    """Free each unit's gathered parameters after its forward (FSDP2's ZeRO-3); False keeps them until backward."""
    fsdp_prefetch: int = 1
    """FSDP units whose all-gather each unit issues, without waiting, once its own parameters are gathered
    (the next ones in forward order; backward prefetches the previous one): their gathers travel while it
    computes. Each costs one more unit's gathered parameters alive at once; 0 = gather each unit when it
    starts, waiting for it (docs/design/comm_overlap.md)."""
    param_dtype: DType = "float32"
    """Dtype the forward and backward compute in (master weights stay float32)."""
    reduce_dtype: DType = "float32"
    """Dtype gradients are reduced and accumulated in."""
    output_dtype: DType | None = None
    """Dtype of the FSDP units' outputs; None = param_dtype."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Process-group backend; auto = NCCL on CUDA, gloo on CPU."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to compute; auto = CUDA when available."""
    collective_timeout_s: float = 300.0
    """How long a collective waits for its peers before the rank gives up (a hung or lost
    peer); passed to init_process_group. Torch's own default is 30 minutes."""

    def validate(self) -> None:
        """Raise ConfigError (one line) at the first invalid [parallel] field."""
        check_positive(self, "parallel", ("dp_replicate", "ep", "pp", "tp", "cp", "pp_stages_per_rank"))
        self._validate_pipeline()
        check(isinstance(self.fsdp_prefetch, int) and not isinstance(self.fsdp_prefetch, bool)
              and self.fsdp_prefetch >= 0, "parallel.fsdp_prefetch", self.fsdp_prefetch,
              "must be an integer >= 0 (units gathered ahead; 0 = off)")
        check(self.dp_shard == -1 or self.dp_shard >= 1, "parallel.dp_shard", self.dp_shard,
              "must be -1 (auto) or >= 1")
        # At most a year: the process group keeps it as a timedelta in C (days fit an int32, not 1e30 s).
        check(0 < self.collective_timeout_s <= 365 * 86400, "parallel.collective_timeout_s", self.collective_timeout_s,
              "must be a finite number of seconds > 0 (at most a year, 31536000)")


    def _validate_pipeline(self) -> None:
        check(self.pp_schedule in PIPELINE_SCHEDULES, "parallel.pp_schedule", self.pp_schedule,
              f"is invalid: use one of {', '.join(PIPELINE_SCHEDULES)}")
        # torch's DualPipeV overlaps one microbatch's forward with another's backward in one action and
        # runs them back to back without an overlap callback: no gain over ZBVZeroBubble, and its
        # expert-parallel all-to-all overlap (the reason to use it) needs a callback nobody registers here.
        check(self.pp_schedule != "DualPipeV", "parallel.pp_schedule", self.pp_schedule,
              "is not supported: torch's DualPipeV brings no overlap without an EP overlap callback; use ZBVZeroBubble")
        stages = self.pp_stages_per_rank
        if self.pp_schedule == "1F1B":
            check(stages == 1, "parallel.pp_stages_per_rank", stages, "must be 1 with parallel.pp_schedule = '1F1B' "
                  "(use Interleaved1F1B or ZBVZeroBubble for several stages per rank)")
        elif self.pp_schedule == "Interleaved1F1B":
            check(stages >= 2, "parallel.pp_stages_per_rank", stages,
                  "must be >= 2 with parallel.pp_schedule = 'Interleaved1F1B' (use 1F1B for one stage per rank)")
        else:
            check(stages == 2, "parallel.pp_stages_per_rank", stages,
                  f"must be 2 with parallel.pp_schedule = {self.pp_schedule!r} (V-shaped: two stages per rank)")

    @property
    def pp_stages(self) -> int:
        """How many stages the layers are split into (1 without pipeline parallelism)."""
        return self.pp * self.pp_stages_per_rank if self.pp > 1 else 1


PIPELINE_SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")


def check_pipeline_job(parallel: ParallelConfig, *, n_layers: int, grad_accum: int, tie_embeddings: bool,
                       batching: str, compile: bool, eval_tasks: bool) -> None:
    """JobConfig's pipeline rules (they read other sections): enough layers for the stages, the microbatches
    torch's schedule needs per step (1F1B: >= pp; Interleaved1F1B: >= pp and a multiple of pp, its rounds;
    ZBV: >= its 2 pp stages), fixed microbatch shapes (a stage's receive buffers are sized once), an
    untied head (embedding and head live on different stages), no compile with ZBV's split backward."""
    if parallel.pp == 1:
        return
    pp, schedule = parallel.pp, parallel.pp_schedule
    check(parallel.pp_stages <= n_layers, "parallel.pp", pp,
          f"x parallel.pp_stages_per_rank = {parallel.pp_stages} stages is more than model.n_layers = {n_layers}")
    check(not tie_embeddings, "model.tie_embeddings", tie_embeddings,
          "with parallel.pp > 1: the embedding and the head live on different stages; untie them")
    check(not eval_tasks, "train.eval_tasks", "[...]", "is not supported with parallel.pp > 1: scoring choices "
          "does not run through pipeline stages; evaluate a checkpoint on one stage")
    check(batching == "packed", "data.batching", batching,
          "with parallel.pp > 1: stages exchange fixed-shape microbatches; use packed batching")
    check(not (compile and schedule == "ZBVZeroBubble"), "train.compile", compile,
          "with parallel.pp_schedule = 'ZBVZeroBubble': torch splits its backward outside compiled graphs; "
          "use 1F1B or Interleaved1F1B")
    needed = 2 * pp if schedule == "ZBVZeroBubble" else pp
    check(grad_accum >= needed, "train.grad_accum", grad_accum,
          f"must be >= {needed} under parallel.pp = {pp} with parallel.pp_schedule = {schedule!r}: "
          "the step's microbatches are the schedule's")
    if schedule == "Interleaved1F1B":
        check(grad_accum % pp == 0, "train.grad_accum", grad_accum,
              f"must be a multiple of parallel.pp = {pp} with parallel.pp_schedule = 'Interleaved1F1B'")


def check_world_size(parallel: ParallelConfig, world_size: int) -> tuple[int, int]:
    """Resolve (dp_replicate, dp_shard) for a world size, or raise ConfigError.

    The world is pp x dp_replicate x dp_shard x cp x tp; the data-parallel ranks are what is left
    after the pipeline, context and tensor dimensions. The expert-parallel group is carved out of
    the shard dimension, so `parallel.ep` must divide dp_shard (every replica group holds every expert).
    """
    model_ranks = parallel.pp * parallel.cp * parallel.tp
    check(world_size % model_ranks == 0, "parallel.pp", parallel.pp,
          f"parallel.pp x parallel.cp x parallel.tp = {parallel.pp} x {parallel.cp} x {parallel.tp} must divide "
          f"the world size {world_size}")
    data_world = world_size // model_ranks
    replicate = parallel.dp_replicate
    if parallel.dp_shard == -1:
        check(data_world % replicate == 0, "parallel.dp_replicate", replicate,
              f"must divide the data-parallel world size {data_world} (world size {world_size} / pp x cp x tp)")
        shard = data_world // replicate
    else:
        check(replicate * parallel.dp_shard == data_world, "parallel.dp_shard", parallel.dp_shard,
              f"parallel.dp_replicate x parallel.dp_shard = {replicate} x {parallel.dp_shard} must equal "
              f"the data-parallel world size {data_world} (world size {world_size} / pp x cp x tp)")
        shard = parallel.dp_shard
    check(shard % parallel.ep == 0, "parallel.ep", parallel.ep,
          f"must divide the data-parallel shard size {shard} (world size {world_size} / parallel.dp_replicate "
          f"{replicate}): the expert-parallel ranks are carved out of it")
    return replicate, shard


def check_sequence_split(parallel: ParallelConfig, model: ModelConfig, data: DataConfig, train: TrainConfig) -> None:
    """What tensor (`parallel.tp`) and context (`parallel.cp`) parallelism need of the job; ConfigError (one line).

    TP splits heads, hidden widths and the vocabulary over its ranks and, between the dense layers, each
    sequence (sequence parallelism); CP splits each sequence into 2 x cp chunks, head-tail balanced. The
    options refused here have no exact TP/CP plan yet (docs/design/parallel.md says why).
    """
    tp, cp = parallel.tp, parallel.cp
    if tp == 1 and cp == 1:
        return
    moe = model.moe
    if tp > 1:
        kv_heads = model.n_kv_heads or model.n_heads
        check(model.n_heads % tp == 0, "parallel.tp", tp, f"must divide model.n_heads = {model.n_heads}")
        check(model.kv_lora_rank is not None or kv_heads % tp == 0, "parallel.tp", tp,
              f"must divide the KV heads (model.n_kv_heads = {kv_heads})")
        for field, value in (("model.ffn_hidden", model.ffn_hidden), ("model.moe.shared_width", moe.shared_width())):
            check(value % tp == 0, "parallel.tp", tp, f"must divide {field} = {value} (the split widths)")
        check(model.qk_norm != "full", "model.qk_norm", model.qk_norm,
              "with parallel.tp > 1: a norm over all heads' channels spans ranks; per_head or none")
        check(not model.tie_embeddings, "model.tie_embeddings", model.tie_embeddings,
              "with parallel.tp > 1: the vocabulary-split embedding and head are not tied yet; use false")
        check(train.sample_tokens == 0, "train.sample_tokens", train.sample_tokens,
              "with parallel.tp > 1: generation's one-token steps cannot be split over the sequence; use 0 "
              "(moetrain sample reads the run's checkpoint in one process)")
    name = "parallel.tp" if tp > 1 else "parallel.cp"
    check(data.batching == "packed", "data.batching", data.batching,
          f"with {name} > 1: a sequence is split over ranks, so every row must be data.seq_len long; use packed")
    check(data.seq_len % (2 * cp * tp) == 0, "data.seq_len", data.seq_len,
          f"must be divisible by 2 x parallel.cp x parallel.tp = {2 * cp * tp} (head-tail chunks, "
          "then the sequence-parallel split)")
    check(not (moe.load_balance == "aux_loss" and moe.aux_loss_coef > 0 and moe.aux_loss_scope == "microbatch"),
          "model.moe.aux_loss_scope", moe.aux_loss_scope,
          f"with {name} > 1: a microbatch's tokens are routed on several ranks; use global_batch (exact)")
    check(not train.compile, "train.compile", train.compile, f"with {name} > 1: not supported yet; use false")
    check(not train.eval_tasks, "train.eval_tasks", train.eval_tasks, f"with {name} > 1: not supported yet")
