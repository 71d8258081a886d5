"""Typed job configuration: dataclasses, TOML loading, CLI overrides, validation.

Every knob of a job lives in one dataclass tree (`JobConfig`). A job is described by a
TOML file under `configs/`; any field can be overridden on the command line as
`--section.field value` (parsed by tyro). `validate()` checks ranges and cross-field
rules and raises `ConfigError` with one line naming the field, the bad value and
what would be valid. Parallel sizes that depend on the world size are checked
by `check_world_size` once the world is known.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import math
import tomllib
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import dacite
import tyro

from moetrain.args import parse_typed_args, print_help, take_option
from moetrain.errors import ConfigError

DType = Literal["float32", "bfloat16", "float16"]
# The names of moetrain.model.init's catalog (a test checks the two agree), typed here so
# that a config is validated without importing the model.
InitScheme = Literal["llama", "gpt-oss", "depth-total", "olmo-normal", "olmo-mitchell", "olmo-megatron", "gpt2",
                     "megatron", "neox"]


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


@dataclass
class ModelConfig:
    vocab_size: int = 259
    """Token vocabulary size (259 = the byte tokenizer's 256 bytes and 3 special tokens)."""
    dim: int = 256
    """Model (residual stream) width."""
    n_layers: int = 4
    """Transformer blocks."""
    n_heads: int = 4
    """Query heads."""
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None = n_heads."""
    head_dim: int | None = None
    """Width of one attention head; None = dim // n_heads (Qwen3-MoE sets it freely, e.g. 128 at dim 2048, 32 heads)."""
    ffn_hidden: int = 512
    """Hidden width of the dense SwiGLU FFN of the first n_dense_layers blocks."""
    n_dense_layers: int = 1
    """The first n_dense_layers blocks use a dense SwiGLU FFN; the rest are MoE (DeepSeek style)."""
    max_seq_len: int = 512
    """Longest sequence the RoPE tables are built for."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_layout: Literal["interleaved", "half"] = "interleaved"
    """Which channels RoPE rotates together: (2j, 2j+1) "interleaved" (torchtitan, Meta Llama) or
    (j, j + head_dim/2) "half" (Hugging Face's rotate_half). The same function up to a fixed
    permutation of the q/k projection rows, which the Hugging Face conversion applies."""
    qk_norm: Literal["none", "per_head", "full"] = "none"
    """RMSNorm on queries and keys before RoPE: over each head's channels (Qwen3) or over the whole
    projected width (OLMoE)."""
    attention: Literal["auto", "dense", "segments", "flex"] = "auto"
    """Document-masked attention (moetrain.model.attention): "auto" = flex attention on CUDA, per-document
    SDPA ("segments") on CPU when the documents make it cheaper; "dense" = the S×S mask (reference)."""
    clip_qkv: float | None = None
    """Clamp q, k and v to [-clip_qkv, clip_qkv] after the projections (and QK-norm); None = off (OLMoE option)."""
    attention_bias: Literal["none", "qkv", "all"] = "none"
    """Biases on the attention projections: none; on q, k and v (Qwen2-MoE, GLM-4.5); or on q, k, v and
    the output projection (GPT-OSS)."""
    attention_sinks: bool = False
    """A learned logit per query head that joins every softmax's denominator and carries no value (GPT-OSS)."""
    sliding_window: int | None = None
    """Keys a query of a sliding-window layer sees, itself included (query i sees keys j > i - sliding_window
    of its own document); None = no sliding window."""
    layer_types: list[Literal["full_attention", "sliding_attention"]] | None = None
    """Per layer, whether it attends within model.sliding_window or to its whole document (transformers'
    layer_types; GPT-OSS alternates them). None = every layer sliding when sliding_window is set (Mixtral)."""
    partial_rotary_factor: float = 1.0
    """Share of each head's channels RoPE rotates, the first int(head_dim * factor) ones (GLM-4.5:
    0.5; the "half" rope_layout only); the rest carry no position. 1 = every channel."""
    rope_scaling: Literal["none", "yarn"] = "none"
    """RoPE frequency scaling: none, or YaRN (arXiv 2309.00071) as DeepSeek-V3 ships it (the rope_yarn_* fields)."""
    rope_yarn_factor: float = 1.0
    """YaRN: context extension factor (interpolated frequencies are divided by it)."""
    rope_yarn_original_max_seq_len: int = 4096
    """YaRN: the context length the model was pre-trained at (original_max_position_embeddings)."""
    rope_yarn_beta_fast: float = 32.0
    """YaRN: rotations bounding the extrapolated (unscaled) high frequencies."""
    rope_yarn_beta_slow: float = 1.0
    """YaRN: rotations bounding the interpolated low frequencies."""
    rope_yarn_mscale: float = 0.0
    """YaRN: cos/sin are multiplied by mscale(factor, rope_yarn_mscale) / mscale(factor, rope_yarn_mscale_all_dim)
    when both are non-zero, else by mscale(factor, 1), where mscale(s, m) = 0.1 · m · ln s + 1 (0 = unset)."""
    rope_yarn_mscale_all_dim: float = 0.0
    """YaRN: MLA multiplies its softmax scale by mscale(factor, this)^2 when non-zero (DeepSeek-V3: 1)."""
    rope_yarn_truncate: bool = True
    """YaRN: round the correction range outwards to whole channels (Hugging Face's default)."""
    kv_lora_rank: int | None = None
    """Multi-head latent attention (MLA, DeepSeek-V2/V3) when set: keys and values come from one shared
    latent of this width (RMSNorm-ed), and one RoPE key part is shared by every head. None = the
    grouped-query attention above (n_kv_heads, head_dim, qk_norm, clip_qkv then do not apply)."""
    q_lora_rank: int | None = None
    """MLA: queries go through a low-rank path of this width with its own RMSNorm; None = one full query
    projection (DeepSeek-V2-Lite, Moonlight)."""
    qk_nope_head_dim: int = 128
    """MLA: per-head query/key channels without position (from the latent)."""
    qk_rope_head_dim: int = 64
    """MLA: per-head query channels with RoPE, and the width of the one RoPE key part all heads share."""
    v_head_dim: int = 128
    """MLA: per-head value width."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    tie_embeddings: bool = False
    """Share the token embedding and the output projection."""
    init_scheme: InitScheme = "llama"
    """Initialization scheme (docs/design/init.md)."""
    init_scale_embedding: bool = False
    """olmo-megatron only: embedding std init_std·sqrt(dim) instead of init_std (OLMo's `scale_emb_init`)."""
    init_from: str | None = None
    """Start from a Hugging Face model directory ("hf:DIR"): weights from its safetensors; the architecture
    fields the TOML and options leave unset come from its config.json (and data.tokenizer from its
    tokenizer.json), those set must agree with it (moetrain.interop.config_map). None = init_scheme."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """The MoE layers."""

    def attention_head_dim(self) -> int:
        """model.head_dim, or dim // n_heads when it is None."""
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads

    def window_of(self, layer: int) -> int | None:
        """The sliding window of block `layer`, or None where it attends to its whole document."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None
    @property
    def attention_kind(self) -> str:
        """"mla" (multi-head latent attention, kv_lora_rank set) or "gqa"; what a Hugging Face family keys on."""
        return "mla" if self.kv_lora_rank is not None else "gqa"

    def rotary_dim(self) -> int:
        """Channels of each query/key head RoPE rotates: MLA's qk_rope_head_dim, else the partial_rotary_factor
        share of the head width."""
        if self.kv_lora_rank is not None:
            return self.qk_rope_head_dim
        return int(self.attention_head_dim() * self.partial_rotary_factor)


@dataclass
class ParallelConfig:
    dp_replicate: int = 1
    """Data-parallel replicas (HSDP's replicate dimension; 1 = plain FSDP)."""
    dp_shard: int = -1
    """Ranks each replica is sharded over (FSDP2); -1 = whatever is left of the world size after dp_replicate."""
    ep: int = 1
    """Expert parallelism: each MoE layer's experts are split into `ep` groups of whole experts,
    over `ep` ranks carved out of dp_shard (tokens travel to their experts by all-to-all);
    expert weights are FSDP-sharded over the dp_shard / ep ranks holding the same experts. 1 = off."""
    sync_policy: Literal["auto", "every_microbatch", "delayed_all_reduce", "final_only"] = "auto"
    """Gradient sync under accumulation; auto = delayed_all_reduce under HSDP with accumulation, else
    every_microbatch (docs/design/parallel.md)."""
    reshard_after_forward: bool = True
    """Free each unit's gathered parameters after its forward (FSDP2's ZeRO-3); False keeps them until backward."""
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


@dataclass
class DataConfig:
    source: Literal["stdlib", "dir", "jsonl", "hf", "tokens"] = "stdlib"
    """stdlib: this interpreter's own standard-library .py sources (embedded, no download); dir: text
    files under data.path; jsonl: a JSON-lines file; hf: a `datasets` save_to_disk directory;
    tokens: a directory written by `moetrain data prepare` (memory-mapped token shards)."""
    path: str | None = None
    """The file or directory of data.source (dir, jsonl, hf, tokens)."""
    glob: str = "**/*"
    """Which files under data.path a 'dir' source reads."""
    text_field: str = "text"
    """The field holding a document's text in JSON-lines records and datasets rows."""
    tokenizer: str = "byte"
    """'byte' (256 bytes + 3 special tokens) or a directory holding a Hugging Face tokenizer.json."""
    seq_len: int = 512
    """Tokens per training sequence."""
    heldout_fraction: float = 0.05
    """Share of documents kept out of training for held-out loss and bits per byte."""
    skip_bad_files: bool = False
    """Skip unreadable or non-UTF-8 inputs with a warning instead of refusing them."""
    max_documents: int | None = None
    """Read at most this many documents; None = all."""
    batching: Literal["packed", "token_budget"] = "packed"
    """packed: microbatches of train.microbatch_size sequences of seq_len tokens. token_budget: each
    microbatch is one row of as many whole documents as fit data.token_budget tokens (longer
    documents cut into budget-size pieces), so lengths vary; train.microbatch_size then only sizes evaluation."""
    token_budget: int | None = None
    """Tokens per microbatch under batching = 'token_budget'; None = data.seq_len."""
    mixture: list[str] = field(default_factory=list)
    """data.source = 'tokens' over several prepared directories, each 'PATH=WEIGHT': every step draws
    units (sequences or token-budget bins) from them in these proportions, in an order that does
    not depend on the number of ranks (exact resume on any world size). Replaces data.path."""
    framing: Literal["bos_eos", "tokenizer"] = "bos_eos"
    """How a text document is framed: bos_eos = [BOS] text [EOS] always; tokenizer = BOS only where the
    tokenizer directory adds one (`add_bos_token` in tokenizer_config.json, else its post-processor),
    EOS always. Conversations are framed by their chat template alone."""
    chat_template: str | None = None
    """Conversations (shards prepared with --format chat): the Jinja chat template file they were
    prepared with when it is not the data.tokenizer directory's own (as `data prepare --chat-template`);
    checked against the manifest's template hash, and written by export-hf."""


@dataclass
class TrainConfig:
    steps: int = 300
    """Optimizer steps of the whole run (the schedule spans them)."""
    microbatch_size: int = 4
    """Sequences per microbatch per rank (under token budgets: per evaluation batch)."""
    grad_accum: int = 1
    """Microbatches per rank per optimizer step."""
    lr: float = 3e-3
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.1
    """The schedule's final learning rate as a fraction of train.lr."""
    warmup_steps: int = 20
    """Steps of linear warm-up from 0 to train.lr."""
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    """Learning-rate schedule after warm-up: cosine decay, warmup-stable-decay, or constant."""
    decay_fraction: float = 0.2
    """WSD: fraction of steps spent in the final decay."""
    weight_decay: float = 0.1
    """AdamW weight decay (matrices only unless decay_norms_and_embeddings)."""
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
    (moetrain.train.task_eval); [] = none."""
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
    stop_at_step: int | None = None
    """End this invocation after this step (checkpoint written) as if interrupted; the
    schedule still spans train.steps. Resume later with --checkpoint.resume True."""
    num_threads: int = 0
    """torch intra-op threads per process; 0 = OMP_NUM_THREADS when set (torchrun sets 1), else
    every usable core unless a short GEMM probe at start finds them busy (moetrain.runtime.threads)."""


@dataclass
class CheckpointConfig:
    enabled: bool = True
    """Write checkpoints."""
    every: int = 100
    """Steps between checkpoints (the last step is always saved)."""
    keep_last: int = 2
    """Complete checkpoints kept; older ones are deleted after a save."""
    resume: bool | Literal["auto"] = False
    """Resume from the newest intact checkpoint: True (one must exist), False (start fresh; refuse to
    overwrite), or "auto" (resume when a checkpoint exists, else start fresh)."""
    allow_schedule_change: bool = False
    """On resume, accept a learning-rate schedule (train.steps, warmup_steps, schedule, decay_fraction,
    min_lr_ratio, lr) other than the checkpoint's; it then bends from the resumed step on."""
    signal_save_after_s: float = 0.0
    """On SIGTERM/SIGINT the run stops at the next step boundary and saves there when a
    save is due or the last save (or the run's start) is older than this many seconds."""
    async_save: bool = False
    """Write checkpoints in the background: the training loop pays only for copying the model and
    optimizer state into host memory (kept for reuse: one more copy of that state per rank); the write,
    hashing, manifest and rename run in a thread while training continues (one save in flight)."""


@dataclass
class LoggingConfig:
    run_dir: str = "runs/tiny_moe"
    """Directory of the run: config.json, metrics.jsonl, checkpoints/, logs/."""
    log_every: int = 10
    """Steps between metrics records and console lines."""
    all_ranks_to_files: bool = False
    """Every rank writes its log to RUN_DIR/logs/ (rank 0 always logs to the console)."""
    progress_bar: bool = True
    """A tqdm progress bar on rank 0."""
    tensorboard: bool = False
    """TensorBoard event files beside metrics.jsonl (extra `tensorboard`)."""
    wandb: bool = False
    """Weights & Biases tracking beside metrics.jsonl (extra `wandb`; WANDB_MODE=offline works without network)."""
    wandb_project: str = "moetrain"
    """The Weights & Biases project."""


@dataclass
class ProfileConfig:
    steps: str = ""
    """Trace steps A to B (inclusive, the step numbers of the log) with torch.profiler, "A-B" or "A";
    each rank writes a Chrome trace into RUN_DIR/profile/. "" = off."""


def parse_step_range(text: str) -> tuple[int, int] | None:
    """profile.steps "A-B" (or "A") -> (A, B); "" -> None; ConfigError when malformed."""
    if not text:
        return None
    first, dash, last = text.partition("-")
    valid = "must be 'A-B' (first and last step to trace, 1 <= A <= B) or '' (off)"
    _check(first.strip().isdigit() and (not dash or last.strip().isdigit()), "profile.steps", text, valid)
    bounds = int(first), int(last if dash else first)
    _check(1 <= bounds[0] <= bounds[1], "profile.steps", text, valid)
    return bounds


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    def validate(self) -> JobConfig:
        _validate(self)
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check(ok: bool, name: str, value: Any, valid: str) -> None:
    if not ok:
        raise ConfigError(f"{name} = {value!r} is invalid: {valid}")


def _check_field_types(obj: Any, prefix: str = "") -> None:
    # Generic checks over every field, so a new field is covered without being listed: a float must
    # be finite (TOML and tyro both accept inf and nan), and an integer field must not hold a
    # boolean (bool is an int subclass, so `steps = true` would otherwise train 1 step).
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, name = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            _check_field_types(value, name + ".")
            continue
        allowed = typing.get_args(hints[f.name]) or (hints[f.name],)
        if isinstance(value, bool) and bool not in allowed:
            raise ConfigError(f"{name} = {value!r} has the wrong type: expected {_type_name(hints[f.name])}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{name} = {value!r} is invalid: must be a finite number")
        if isinstance(value, int) and not -(1 << 63) < value < 1 << 63:  # torch and C code overflow past int64
            raise ConfigError(f"{name} = {value!r} is invalid: beyond the 64-bit integer range")


def _validate(cfg: JobConfig) -> None:
    _check_field_types(cfg)
    m, moe, p, d, t, c, lg = cfg.model, cfg.model.moe, cfg.parallel, cfg.data, cfg.train, cfg.checkpoint, cfg.logging
    positive = {
        "model.vocab_size": m.vocab_size, "model.dim": m.dim, "model.n_layers": m.n_layers,
        "model.n_heads": m.n_heads, "model.ffn_hidden": m.ffn_hidden, "model.max_seq_len": m.max_seq_len,
        "model.moe.n_experts": moe.n_experts, "model.moe.top_k": moe.top_k,
        "model.moe.expert_hidden": moe.expert_hidden, "model.moe.token_rounding_tile": moe.token_rounding_tile,
        "parallel.dp_replicate": p.dp_replicate, "parallel.ep": p.ep, "data.seq_len": d.seq_len, "train.steps": t.steps,
        "train.microbatch_size": t.microbatch_size, "train.grad_accum": t.grad_accum,
        "train.activation_checkpointing_every": t.activation_checkpointing_every,
        "train.eval_batches": t.eval_batches, "train.max_consecutive_skips": t.max_consecutive_skips,
        "checkpoint.every": c.every, "checkpoint.keep_last": c.keep_last,
        "logging.log_every": lg.log_every,
    }
    for name, value in positive.items():
        _check(value >= 1, name, value, "must be a positive integer")
    nonneg = {
        "model.n_dense_layers": m.n_dense_layers, "model.moe.n_shared_experts": moe.n_shared_experts,
        "model.moe.aux_loss_coef": moe.aux_loss_coef, "model.moe.bias_update_rate": moe.bias_update_rate,
        "model.moe.z_loss_coef": moe.z_loss_coef,
        "train.warmup_steps": t.warmup_steps, "train.weight_decay": t.weight_decay,
        "train.grad_clip": t.grad_clip, "train.eval_every": t.eval_every, "train.sample_tokens": t.sample_tokens,
        "train.num_threads": t.num_threads, "train.eval_tasks_limit": t.eval_tasks_limit,
    }
    for name, value in nonneg.items():
        _check(value >= 0, name, value, "must be >= 0")
    _check(m.rope_theta > 0, "model.rope_theta", m.rope_theta, "must be > 0")
    _validate_attention_variants(m)
    _check(m.norm_eps > 0, "model.norm_eps", m.norm_eps, "must be > 0")
    if m.kv_lora_rank is not None:
        pass  # multi-head latent attention has widths of its own (checked in _validate_attention_variants)
    elif m.head_dim is None:
        _check(m.dim % m.n_heads == 0, "model.n_heads", m.n_heads,
               f"must divide model.dim = {m.dim} (or set model.head_dim)")
        _check((m.dim // m.n_heads) % 2 == 0, "model.n_heads", m.n_heads,
               f"head dim model.dim / model.n_heads = {m.dim / m.n_heads:g} must be even for RoPE")
    else:
        _check(m.head_dim >= 2 and m.head_dim % 2 == 0, "model.head_dim", m.head_dim,
               "must be a positive even integer (RoPE rotates channel pairs) or None")
    if m.clip_qkv is not None:
        _check(m.clip_qkv > 0, "model.clip_qkv", m.clip_qkv, "must be > 0 or None")
    if m.init_from is not None:
        _check(m.init_from.startswith("hf:") and len(m.init_from) > 3, "model.init_from", m.init_from,
               "must be 'hf:DIR' (a Hugging Face model directory) or None")
        _check_tokenizer_travels(m.init_from[3:], d.tokenizer)
    if m.n_kv_heads is not None:
        _check(m.n_kv_heads >= 1 and m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads", m.n_kv_heads,
               f"must be a positive divisor of model.n_heads = {m.n_heads}")
    _check(m.n_dense_layers <= m.n_layers, "model.n_dense_layers", m.n_dense_layers,
           f"must be <= model.n_layers = {m.n_layers}")
    if m.sliding_window is not None:
        _check(m.sliding_window >= 1, "model.sliding_window", m.sliding_window, "must be >= 1 or None (off)")
    if m.layer_types is not None:
        _check(len(m.layer_types) == m.n_layers, "model.layer_types", m.layer_types,
               f"must name one type per layer (model.n_layers = {m.n_layers}) or be None")
        _check(m.sliding_window is not None or "sliding_attention" not in m.layer_types, "model.layer_types",
               m.layer_types, "has sliding_attention layers but model.sliding_window is None")
    if moe.shared_expert_hidden is not None:
        _check(moe.shared_expert_hidden >= 1 and moe.n_shared_experts >= 1, "model.moe.shared_expert_hidden",
               moe.shared_expert_hidden, "must be >= 1, with model.moe.n_shared_experts >= 1, or None")
    _check(not moe.shared_expert_gate or moe.n_shared_experts >= 1, "model.moe.shared_expert_gate",
           moe.shared_expert_gate, "needs a shared expert (model.moe.n_shared_experts >= 1)")
    if moe.activation == "clamped_swiglu":
        _check(moe.swiglu_limit > 0, "model.moe.swiglu_limit", moe.swiglu_limit, "must be > 0")
    _check(moe.top_k <= moe.n_experts, "model.moe.top_k", moe.top_k,
           f"must be <= model.moe.n_experts = {moe.n_experts}")
    # One renormalised gate is g / g = 1 whatever the router says: the LM loss would never train it.
    _check(not (moe.top_k == 1 and moe.renormalize and m.n_dense_layers < m.n_layers), "model.moe.renormalize",
           moe.renormalize, "with model.moe.top_k = 1 every gate is exactly 1, so the router gets no gradient from "
           "the language-model loss; set model.moe.renormalize = False (Switch's gate) or model.moe.top_k >= 2")
    _check(d.seq_len <= m.max_seq_len, "data.seq_len", d.seq_len, f"must be <= model.max_seq_len = {m.max_seq_len}")
    if d.token_budget is not None:
        _check(d.batching == "token_budget", "data.token_budget", d.token_budget,
               "is only used under data.batching = 'token_budget' (batching is 'packed'); set that, or leave "
               "data.token_budget unset")
        # A piece of a long document is budget tokens long, so positions reach budget - 1.
        _check(1 <= d.token_budget <= m.max_seq_len, "data.token_budget", d.token_budget,
               f"must be in [1, model.max_seq_len = {m.max_seq_len}] or None (= data.seq_len)")
    # A bin's row is as long as its documents ([1, L], L <= budget), so compiled blocks with static shapes
    # would recompile for every new L.
    _check(not (t.compile and d.batching == "token_budget"), "data.batching", d.batching,
           "with train.compile = True: each microbatch's row length differs (a recompile per length); "
           "use packed batching or train.compile = False")
    _check(p.dp_shard == -1 or p.dp_shard >= 1, "parallel.dp_shard", p.dp_shard, "must be -1 (auto) or >= 1")
    if p.ep > 1:
        _check(not moe.expert_proj_bias, "model.moe.expert_proj_bias", moe.expert_proj_bias,
               "expert parallelism does not move expert biases yet; use parallel.ep = 1")
        _check(m.n_dense_layers < m.n_layers, "parallel.ep", p.ep,
               f"expert parallelism needs an MoE layer, but all model.n_layers = {m.n_layers} layers are dense; use 1")
        _check(moe.n_experts % p.ep == 0, "parallel.ep", p.ep,
               f"must divide model.moe.n_experts = {moe.n_experts} (each rank owns whole experts)")
    _check(t.lr > 0, "train.lr", t.lr, "must be > 0")
    _check(t.warmup_steps < t.steps, "train.warmup_steps", t.warmup_steps,
           f"must be < train.steps = {t.steps} (the schedule would never leave warm-up)")
    # At most a year: the process group keeps it as a timedelta in C (days fit an int32, not 1e30 s).
    _check(0 < p.collective_timeout_s <= 365 * 86400, "parallel.collective_timeout_s", p.collective_timeout_s,
           "must be a finite number of seconds > 0 (at most a year, 31536000)")
    _check(0 <= c.signal_save_after_s < float("inf"), "checkpoint.signal_save_after_s", c.signal_save_after_s,
           "must be a finite number of seconds >= 0")
    _check(0 <= t.min_lr_ratio <= 1, "train.min_lr_ratio", t.min_lr_ratio, "must be in [0, 1]")
    _check(0 < t.decay_fraction <= 1, "train.decay_fraction", t.decay_fraction, "must be in (0, 1]")
    _check(0 <= t.beta1 < 1, "train.beta1", t.beta1, "must be in [0, 1)")
    _check(0 <= t.beta2 < 1, "train.beta2", t.beta2, "must be in [0, 1)")
    _check(t.eps > 0, "train.eps", t.eps, "must be > 0")
    _check(t.peak_flops >= 0, "train.peak_flops", t.peak_flops, "must be >= 0 (0 = measure)")
    _check(t.sample_temperature >= 0, "train.sample_temperature", t.sample_temperature, "must be >= 0 (0 = greedy)")
    _check(0 < t.sample_top_p <= 1, "train.sample_top_p", t.sample_top_p, "must be in (0, 1]")
    if t.stop_at_step is not None:
        _check(1 <= t.stop_at_step <= t.steps, "train.stop_at_step", t.stop_at_step,
               f"must be in [1, train.steps = {t.steps}]")
    _check(0 <= d.heldout_fraction < 1, "data.heldout_fraction", d.heldout_fraction, "must be in [0, 1)")
    if d.max_documents is not None:
        _check(d.max_documents >= 1, "data.max_documents", d.max_documents, "must be >= 1")
    _check(d.source == "stdlib" or d.path is not None, "data.path", d.path,
           f"a path is required when data.source = {d.source!r}")
    _check(bool(lg.run_dir), "logging.run_dir", lg.run_dir, "must be a non-empty path")
    parse_step_range(cfg.profile.steps)
    _check(not lg.wandb or importlib.util.find_spec("wandb") is not None, "logging.wandb", lg.wandb,
           "needs the `wandb` package: pip install moetrain[wandb], or set it to False")
    schemes = typing.get_args(InitScheme)
    _check(m.init_scheme in schemes, "model.init_scheme", m.init_scheme, f"valid schemes: {', '.join(schemes)}")
    _check(not m.init_scale_embedding or m.init_scheme == "olmo-megatron", "model.init_scale_embedding",
           m.init_scale_embedding, f"only the 'olmo-megatron' scheme has it (model.init_scheme = {m.init_scheme!r})")


def _validate_attention_variants(m: ModelConfig) -> None:
    """MLA, partial rotary, YaRN and group-limited routing fields."""
    moe = m.moe
    _check(0 < m.partial_rotary_factor <= 1, "model.partial_rotary_factor", m.partial_rotary_factor,
           "must be in (0, 1]")
    if m.partial_rotary_factor < 1:
        _check(m.rope_layout == "half", "model.partial_rotary_factor", m.partial_rotary_factor,
               f"partial rotary is computed in the 'half' RoPE layout only (model.rope_layout = {m.rope_layout!r})")
        _check(m.rotary_dim() >= 2 and m.rotary_dim() % 2 == 0, "model.partial_rotary_factor",
               m.partial_rotary_factor,
               f"must rotate an even number of channels >= 2 (head_dim = {m.attention_head_dim()})")
    if m.rope_scaling == "yarn":
        _check(m.rope_yarn_factor >= 1, "model.rope_yarn_factor", m.rope_yarn_factor, "must be >= 1")
        _check(m.rope_yarn_original_max_seq_len >= 1, "model.rope_yarn_original_max_seq_len",
               m.rope_yarn_original_max_seq_len, "must be a positive integer")
        _check(m.rope_yarn_beta_fast > 0 and m.rope_yarn_beta_slow > 0, "model.rope_yarn_beta_fast",
               (m.rope_yarn_beta_fast, m.rope_yarn_beta_slow), "rope_yarn_beta_fast and _slow must be > 0")
    if m.kv_lora_rank is not None:
        for name, value in (("kv_lora_rank", m.kv_lora_rank), ("q_lora_rank", m.q_lora_rank),
                            ("qk_nope_head_dim", m.qk_nope_head_dim), ("v_head_dim", m.v_head_dim)):
            if value is not None:
                _check(value >= 1, f"model.{name}", value, "must be a positive integer")
        _check(m.qk_rope_head_dim >= 2 and m.qk_rope_head_dim % 2 == 0, "model.qk_rope_head_dim",
               m.qk_rope_head_dim, "must be a positive even integer (RoPE rotates channel pairs)")
        _check(m.attention_bias == "none", "model.attention_bias", m.attention_bias,
               "MLA (model.kv_lora_rank set) has no projection biases")
        _check(not m.attention_sinks and m.sliding_window is None, "model.kv_lora_rank", m.kv_lora_rank,
               "MLA is not combined with attention sinks or sliding windows")
        _check(m.partial_rotary_factor == 1, "model.partial_rotary_factor", m.partial_rotary_factor,
               "MLA rotates its qk_rope_head_dim channels; leave it at 1")
    _check(moe.n_group >= 1 and moe.n_experts % moe.n_group == 0, "model.moe.n_group", moe.n_group,
           f"must be a positive divisor of model.moe.n_experts = {moe.n_experts}")
    if moe.n_group > 1:
        _check(moe.n_experts // moe.n_group >= 2, "model.moe.n_group", moe.n_group,
               "groups are scored by their top-2 experts, so each needs >= 2 experts")
    _check(1 <= moe.topk_group <= moe.n_group, "model.moe.topk_group", moe.topk_group,
           f"must be in [1, model.moe.n_group = {moe.n_group}]")
    _check(moe.top_k <= moe.topk_group * (moe.n_experts // moe.n_group), "model.moe.top_k", moe.top_k,
           f"must be <= the experts in topk_group = {moe.topk_group} groups")
    _check(moe.routed_scaling_factor > 0, "model.moe.routed_scaling_factor", moe.routed_scaling_factor, "must be > 0")


def _check_tokenizer_travels(model_dir: str, tokenizer: str) -> None:
    # A model directory's tokenizer.json is the model's tokenizer: training it on other token ids
    # would silently mean something else, so the job must name it (the directory or the file).
    carried = Path(model_dir) / "tokenizer.json"
    if not carried.is_file():
        return
    named = Path(tokenizer)
    named = named / "tokenizer.json" if named.is_dir() else named
    _check(named.is_file() and named.resolve() == carried.resolve(), "data.tokenizer", tokenizer,
           f"model.init_from = 'hf:{model_dir}' carries its tokenizer: use --data.tokenizer {model_dir}")


def check_world_size(parallel: ParallelConfig, world_size: int) -> tuple[int, int]:
    """Resolve (dp_replicate, dp_shard) for a world size, or raise ConfigError.

    The expert-parallel group is carved out of the shard dimension, so `parallel.ep` must
    divide dp_shard (every replica group holds every expert).
    """
    replicate = parallel.dp_replicate
    if parallel.dp_shard == -1:
        _check(world_size % replicate == 0, "parallel.dp_replicate", replicate,
               f"must divide the world size {world_size}")
        shard = world_size // replicate
    else:
        _check(replicate * parallel.dp_shard == world_size, "parallel.dp_shard", parallel.dp_shard,
               f"parallel.dp_replicate x parallel.dp_shard = {replicate} x {parallel.dp_shard} must equal "
               f"the world size {world_size}")
        shard = parallel.dp_shard
    _check(shard % parallel.ep == 0, "parallel.ep", parallel.ep,
           f"must divide the data-parallel shard size {shard} (world size {world_size} / parallel.dp_replicate "
           f"{replicate}): the expert-parallel ranks are carved out of it")
    return replicate, shard


def _check_known_keys(data: Any, cls: type, where: str, prefix: str = "") -> None:
    # One line naming the section and the closest valid key (dacite names neither).
    if not isinstance(data, dict):
        return
    hints = typing.get_type_hints(cls)
    for key, value in data.items():
        if key in hints:
            if dataclasses.is_dataclass(hints[key]):
                _check_known_keys(value, hints[key], where, f"{prefix}{key}.")
            continue
        section = f"[{prefix[:-1]}]" if prefix else "the top level"
        close = difflib.get_close_matches(str(key), list(hints), n=1)
        hint = f"did you mean {prefix}{close[0]}? " if close else ""
        raise ConfigError(f"{where}: unknown key {prefix}{key} in {section}; {hint}valid keys there: "
                          f"{', '.join(hints)}")


def from_dict(data: dict[str, Any], where: str = "config") -> JobConfig:
    """Build a JobConfig from nested dicts, rejecting unknown keys and wrong types."""
    _check_known_keys(data, JobConfig, where)
    try:
        return dacite.from_dict(JobConfig, _ints_to_floats(data, JobConfig), config=dacite.Config(strict=True))
    except dacite.UnexpectedDataError as err:
        raise ConfigError(f"unknown config key(s) {sorted(err.keys)}; valid keys are the fields of "
                          "moetrain.config.JobConfig") from None
    except dacite.WrongTypeError as err:
        expected = _type_name(err.field_type)
        raise ConfigError(f"{err.field_path} = {err.value!r} has the wrong type: expected {expected}") from None
    except dacite.DaciteError as err:
        raise ConfigError(f"bad config: {err}") from None


def _ints_to_floats(data: Any, cls: type, prefix: str = "") -> Any:
    # TOML writes 1 for 1.0: turn ints into floats where the field is a float. dacite
    # accepts bools as numbers, so they are rejected here, by field name.
    if not isinstance(data, dict):
        return data
    hints = typing.get_type_hints(cls)
    out = dict(data)
    for key, value in data.items():
        hint = hints.get(key)
        if dataclasses.is_dataclass(hint):
            out[key] = _ints_to_floats(value, hint, f"{prefix}{key}.")
        elif float in (hint, *typing.get_args(hint)):
            if isinstance(value, bool):
                raise ConfigError(f"{prefix}{key} = {value!r} has the wrong type: expected a number")
            if type(value) is int:
                out[key] = float(value)
    return out


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(tp))
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def load(path: str | Path) -> JobConfig:
    """Load and validate a TOML config file."""
    return from_dict(read_toml(path), str(path)).validate()


def read_toml(path: str | Path) -> dict[str, Any]:
    """A TOML config file's contents as nested dicts, or one ConfigError line saying why not."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {str(path)!r} is a directory; pass a TOML file")
    if not path.exists():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    if not path.is_file():  # a FIFO or device: reading it would block or never end
        raise ConfigError(f"config file {str(path)!r} is not a regular file; pass a TOML file")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"config file {str(path)!r} is unreadable ({err.strerror or type(err).__name__})") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (bad byte at offset {err.start})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {err}") from None
    return data


def apply_overrides(cfg: JobConfig, args: list[str], prog: str = "moetrain train") -> JobConfig:
    """Apply `--section.field value` command-line overrides (typed by tyro) and re-validate."""
    if not args:
        return cfg.validate()
    return parse_typed_args(JobConfig, args, prog, default=cfg).validate()


def to_toml(cfg: JobConfig, comments: dict[str, str] | None = None) -> str:
    """`cfg` as a TOML job file (`None` fields left out, as a comment); `comments`: "section.field" -> text
    written above that field."""
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)  # a JSON string is a TOML basic string
        return repr(v)

    def section(obj: Any, name: str) -> list[str]:
        rows, nested = [f"[{name}]"], []
        for f in dataclasses.fields(obj):
            v, path = getattr(obj, f.name), f"{name}.{f.name}"
            if dataclasses.is_dataclass(v):
                nested.append((v, path))
                continue
            for line in (comments or {}).get(path, "").splitlines():
                rows.append(f"# {line}".rstrip())
            rows.append(f"# {f.name} = (none)" if v is None else f"{f.name} = {value(v)}")
        for v, path in nested:
            rows += ["", *section(v, path)]
        return rows

    out: list[str] = []
    for f in dataclasses.fields(cfg):
        out += [*section(getattr(cfg, f.name), f.name), ""]
    return "\n".join(out)


@dataclass(frozen=True)
class CommandOption:
    """An option a job command (train, bench train, estimate) reads beside the job's fields, for its --help."""

    name: str
    type: Any
    default: Any
    help: str


CONFIG_OPTION_HELP = ("TOML job file; its values are the defaults the --section.field options override "
                      "(none = the built-in defaults)")


def print_job_help(prog: str, description: str, options: Sequence[CommandOption] = ()) -> None:
    """`prog --help`: --config, the command's own options, then every job field (each with its docstring)."""
    fields: list[Any] = [("config", Annotated[str | None, tyro.conf.arg(help=CONFIG_OPTION_HELP, metavar="FILE")],
                          None)]
    fields += [(o.name, Annotated[o.type, tyro.conf.arg(help=o.help)], o.default) for o in options]
    fields.append(("job", Annotated[JobConfig, tyro.conf.arg(name=""), tyro.conf.FlagConversionOff],
                   field(default_factory=JobConfig)))
    command_line = dataclasses.make_dataclass("JobCommandLine", fields)
    command_line.__doc__ = description
    print_help(command_line, prog, bool_flags=True)  # the command's booleans are flags; the job's take values


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def parse_job_args(argv: list[str], prog: str = "moetrain train",
                   init_from_defaults: Callable[[str], JobConfig] | None = None,
                   description: str = "", options: Sequence[CommandOption] = ()) -> JobConfig:
    """`--config PATH [--section.field value ...]` -> validated JobConfig (`--help`: print_job_help).

    With `init_from_defaults` and a `model.init_from` (TOML or command line), the job's defaults are
    `init_from_defaults(value)` (a Hugging Face directory's architecture and tokenizer) instead of the
    built-in ones: what the TOML and the options set explicitly still wins, and is checked against the
    directory when the model is built.
    """
    if any(a in ("-h", "--help") for a in argv):
        print_job_help(prog, description, options)
    config_path, rest = take_option(argv, "config")
    data = read_toml(config_path) if config_path else {}
    init_from, _ = take_option(rest, "model.init_from")
    if init_from is None and isinstance(data.get("model"), dict):
        init_from = data["model"].get("init_from")
    if init_from_defaults is not None and isinstance(init_from, str) and init_from.startswith("hf:"):
        base = init_from_defaults(init_from).to_dict()
        data = _merge({"model": base["model"], "data": {k: base["data"][k] for k in ("tokenizer", "seq_len")}}, data)
    return apply_overrides(from_dict(data, config_path or "config"), rest, prog=prog)
