"""The [train] section: steps, batch, optimizer, schedule, recomputation, evaluation, sampling; its checks.

A rule that also reads another section (compile with token-budget batches) is JobConfig's. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from moetrain.config.checks import check, check_nonnegative, check_positive

# The parameter groups per-group rates name, and which of them `train.muon_groups` may put on Muon.
# "norms" (block and final RMSNorm gains) is 1-D only: Muon cannot orthogonalize it.
PARAM_GROUPS = ("router", "experts", "attention", "dense_ffn", "embeddings", "head", "norms")
MUON_REFUSED_GROUPS = ("norms",)
NewtonSchulzDType = Literal["bfloat16", "float32", "float64"]


@dataclass
class GroupScales:
    """A multiplier per parameter group (moetrain.train.optim.param_role says which parameter is in which);
    1 = the base value. Block and final norms always take the base value."""

    router: float = 1.0
    """Router weights (and the shared-expert gate)."""
    experts: float = 1.0
    """Routed-expert weights (and their stacked biases)."""
    attention: float = 1.0
    """Attention projections, QK-norms, sinks, MLA's latent norms."""
    dense_ffn: float = 1.0
    """Dense feed-forward blocks and shared experts."""
    embeddings: float = 1.0
    """Token embedding (and a head tied to it)."""
    head: float = 1.0
    """The untied output projection."""

    def of(self, group: str) -> float:
        """The multiplier of `group` (one of PARAM_GROUPS; "norms" is 1)."""
        return 1.0 if group == "norms" else getattr(self, group)

    def validate(self, prefix: str) -> None:
        check_nonnegative(self, prefix, [name for name in PARAM_GROUPS if name != "norms"])


@dataclass
class TrainConfig:
    steps: int = 300
    """Optimizer steps of the whole run (the schedule spans them)."""
    microbatch_size: int = 4
    """Sequences per microbatch per rank (under token budgets: per evaluation batch)."""
    grad_accum: int = 1
    """Microbatches per rank per optimizer step."""
    lr: float = 3e-3
    """Peak learning rate (AdamW, and Muon's through its RMS matching: moetrain.train.muon)."""
    optimizer: Literal["adamw", "muon"] = "adamw"
    """"muon": Muon (orthogonalized momentum) on the matrices of train.muon_groups, AdamW on every other
    parameter (docs/design/optimizers.md); "adamw": AdamW on everything."""
    muon_groups: list[str] = field(default_factory=lambda: ["attention", "dense_ffn", "experts"])
    """Parameter groups whose matrices Muon updates (the rest, and every 1-D parameter, take AdamW): any of
    router, experts, attention, dense_ffn, embeddings, head."""
    muon_momentum: float = 0.95
    """Muon's momentum (torch.optim.Muon's EMA form)."""
    muon_nesterov: bool = True
    """Nesterov momentum for Muon."""
    muon_ns_steps: int = 5
    """Newton-Schulz iterations per orthogonalization."""
    muon_ns_dtype: NewtonSchulzDType = "bfloat16"
    """Dtype the Newton-Schulz iteration computes in (torch.optim.Muon's is bfloat16)."""
    lr_scale: GroupScales = field(default_factory=GroupScales)
    """Per-group multipliers of the learning rate (both optimizers)."""
    weight_decay_scale: GroupScales = field(default_factory=GroupScales)
    """Per-group multipliers of train.weight_decay (both optimizers; not-decayed parameters stay at 0)."""
    qk_clip_tau: float = 0.0
    """QK-clip (MuonClip): after each step, scale the query and key weights of every attention head whose
    largest pre-softmax logit in the step exceeded this, so that it would be this; 0 = off."""
    min_lr_ratio: float = 0.1
    """The schedule's final learning rate as a fraction of train.lr."""
    warmup_steps: int = 20
    """Steps of linear warm-up from 0 to train.lr."""
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    """Learning-rate schedule after warm-up: cosine decay, warmup-stable-decay, or constant."""
    decay_fraction: float = 0.2
    """WSD: fraction of steps spent in the final decay."""
    weight_decay: float = 0.1
    """Decoupled weight decay, AdamW's and Muon's (matrices only unless decay_norms_and_embeddings)."""
    decay_norms_and_embeddings: bool = False
    """Apply weight decay to norm weights and embeddings too."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 = no clipping."""
    seed: int = 0
    """Seed of the init, the data order and sampling."""
    activation_checkpointing: bool | Literal["none", "full", "selective"] = False
    """Recompute activations in backward instead of storing them: "full" (or true) recomputes whole
    blocks from their input; "selective" keeps every matmul's and attention kernel's output and
    recomputes only the cheap ops between them; "none" (or false) stores everything."""
    activation_checkpointing_every: int = 1
    """Checkpoint only blocks 0, N, 2N, ... (N = this); 1 = every block."""
    compile: bool = False
    """torch.compile each transformer block."""
    float8: Literal["none", "tensorwise", "rowwise"] = "none"
    """FP8 matmuls through torchao (moetrain.parallel.float8): the attention, dense FFN and shared-expert
    linears run in float8 with one scale per tensor ("tensorwise", with FSDP's float8 weight all-gather)
    or per row ("rowwise"); routers, norms, embeddings, the head and the routed experts stay in
    parallel.param_dtype, and the master weights and checkpoints stay float32. "none" = off."""
    nan_policy: Literal["skip", "stop"] = "stop"
    """A step whose loss or gradient norm is NaN/inf: skip it (no optimizer step) or stop the run."""
    max_consecutive_skips: int = 10
    """nan_policy = "skip": this many non-finite steps in a row end the run (TrainingDiverged);
    a run that keeps producing NaN is not recovering, and skipping forever only burns compute."""
    eval_every: int = 100
    """Steps between held-out evaluations; 0 = only the final one."""
    eval_batches: int = 8
    """Held-out batches per evaluation."""
    eval_tasks: list[str] = field(default_factory=list)
    """Multiple-choice task files scored at every evaluation (and the final one), split over the ranks: JSONL
    lines {"query": str, "choices": [str, ...], "gold": int}, lm-evaluation-harness's acc and acc_norm
    (moetrain.evaluate.tasks); [] = none."""
    eval_tasks_limit: int = 0
    """Documents per train.eval_tasks file at most (the first N); 0 = all."""
    peak_flops: float = 0.0
    """MFU's peak FLOP/s per rank; 0 = measured at start (moetrain.observe.peak_flops)."""
    sample_tokens: int = 200
    """Tokens sampled from the model at the end of the run; 0 = none."""
    sample_prompt: str = "def "
    """Prompt of the end-of-run sample."""
    sample_temperature: float = 0.8
    """Temperature of the end-of-run sample; 0 = greedy."""
    sample_top_p: float = 0.95
    """Nucleus (top-p) cut of the end-of-run sample."""
    mtp_loss_weight: float = 0.3
    """λ of the multi-token-prediction loss (model.mtp_depth > 0): the step's loss is the main loss + λ/D · Σ_k
    CE_k over the D modules (DeepSeek-V3 trained with 0.3, then 0.1); 0 = the MTP modules are neither run nor
    trained (kept as they are, e.g. for export or speculative decoding)."""
    stop_at_step: int | None = None
    """End this invocation after this step (checkpoint written) as if interrupted; the
    schedule still spans train.steps. Resume later with --checkpoint.resume True."""
    num_threads: int = 0
    """torch intra-op threads per process; 0 = OMP_NUM_THREADS when set (torchrun sets 1), else
    every usable core unless a short GEMM probe at start finds them busy (moetrain.runtime.threads)."""

    def validate(self) -> None:
        """Raise ConfigError (one line) at the first invalid [train] field."""
        check_positive(self, "train", ("steps", "microbatch_size", "grad_accum", "activation_checkpointing_every",
                                       "eval_batches", "max_consecutive_skips"))
        check_nonnegative(self, "train", ("warmup_steps", "weight_decay", "grad_clip", "eval_every", "sample_tokens",
                                          "num_threads", "eval_tasks_limit", "mtp_loss_weight"))
        check(self.lr > 0, "train.lr", self.lr, "must be > 0")
        check(self.warmup_steps < self.steps, "train.warmup_steps", self.warmup_steps,
              f"must be < train.steps = {self.steps} (the schedule would never leave warm-up)")
        check(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1]")
        check(0 < self.decay_fraction <= 1, "train.decay_fraction", self.decay_fraction, "must be in (0, 1]")
        check(0 <= self.beta1 < 1, "train.beta1", self.beta1, "must be in [0, 1)")
        check(0 <= self.beta2 < 1, "train.beta2", self.beta2, "must be in [0, 1)")
        check(self.eps > 0, "train.eps", self.eps, "must be > 0")
        self._validate_optimizer()
        check(self.peak_flops >= 0, "train.peak_flops", self.peak_flops, "must be >= 0 (0 = measure)")
        check(self.sample_temperature >= 0, "train.sample_temperature", self.sample_temperature,
              "must be >= 0 (0 = greedy)")
        check(0 < self.sample_top_p <= 1, "train.sample_top_p", self.sample_top_p, "must be in (0, 1]")
        if self.stop_at_step is not None:
            check(1 <= self.stop_at_step <= self.steps, "train.stop_at_step", self.stop_at_step,
                  f"must be in [1, train.steps = {self.steps}]")

    def _validate_optimizer(self) -> None:
        self.lr_scale.validate("train.lr_scale")
        self.weight_decay_scale.validate("train.weight_decay_scale")
        for name in self.muon_groups:
            check(name in PARAM_GROUPS, "train.muon_groups", self.muon_groups,
                  f"{name!r} is not a parameter group: use any of {', '.join(PARAM_GROUPS[:-1])}")
            check(name not in MUON_REFUSED_GROUPS, "train.muon_groups", self.muon_groups,
                  f"{name!r} holds 1-D parameters only, which Muon cannot orthogonalize")
        check(0 <= self.muon_momentum < 1, "train.muon_momentum", self.muon_momentum, "must be in [0, 1)")
        check(1 <= self.muon_ns_steps < 100, "train.muon_ns_steps", self.muon_ns_steps, "must be in [1, 99]")
        check(self.qk_clip_tau >= 0, "train.qk_clip_tau", self.qk_clip_tau,
              "must be > 0 (the logit bound), or 0 for no QK-clip")
        check(not (self.qk_clip_tau > 0 and self.compile), "train.qk_clip_tau", self.qk_clip_tau,
              "QK-clip records each head's largest logit outside the compiled graph: use train.compile = False")
