"""Training memory per rank estimated from the config alone, before anything is allocated.

`estimate_training_memory(cfg, dp_shard)` adds up, in bytes per rank:
- parameters and optimizer state: 16 bytes per parameter (float32 weight, float32 gradient,
  AdamW's two float32 moments; under `train.optimizer = "muon"` the matrices Muon updates keep one
  float32 momentum buffer instead, `optimizer_state_bytes`), the parameters sharded over the
  `dp_shard` ranks (FSDP; replicas under HSDP hold a full shard each);
- activations saved for backward by one microbatch (`train.microbatch_size` × `data.seq_len`
  tokens, or one row of `data.token_budget` tokens; only one microbatch is alive at a time):
  per token and layer the norm inputs and outputs, q/k/v, the attention output, the FFN's
  hidden activations (MoE: router logits and
  the top-k experts' hidden H, as the memory-efficient backward saves them), then the float32
  logits and their log-softmax. With activation checkpointing only each layer's input stays,
  plus one layer recomputed at a time;
- the document-causal attention mask `[microbatch, 1, seq, seq]` of booleans, built once per
  forward (`moetrain.model.layers.document_causal_mask`).

With LoRA (`lora.rank > 0`) the frozen base is stored in the compute dtype with no gradient and no
optimizer state; only the adapters (`config.lora.adapter_count`) keep float32 weights, gradients and
moments, and a MoE layer with routed-expert adapters forms its folded expert weights and their
gradient in backward (two expert stacks in the compute dtype, one layer at a time).

It is an estimate of what certainly gets allocated (no allocator overhead, no temporary
buffers, no FSDP all-gather buffers), so a config it says does not fit certainly does not.

`estimate_peak(cfg, dp_shard, device_type, process_bytes, data_bytes, ...)` is the best estimate of
the peak instead, what `moetrain estimate` and `train --dry-run` report: the process itself and the
data (both measured by the caller), the state, the activations counted per storage as autograd
saves them (under expert parallelism the received rows the experts keep), one block's backward working
set, the float32 logits, FSDP2's unsharded blocks (under expert parallelism only this rank's E/ep
experts of a block, gathered over the dp_shard/ep ranks holding them) and the host heap's slack
(benchmarks/profile/estimate_accuracy.py compares it with the peak RSS of real runs).
This module reads the config; it never builds a model, allocates tensors or looks at the machine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from moetrain.config.job import JobConfig
from moetrain.config.lora import adapter_count
from moetrain.config.model import ModelConfig
from moetrain.dtypes import DTYPES
from moetrain.model.flops import _attention_params, count_params
from moetrain.model.gemm_attention import gemm_attention_saved_keys
from moetrain.model.tiled_attention import TILE_SCORES

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# float32 weight + float32 gradient + AdamW exp_avg and exp_avg_sq.
TRAINING_BYTES_PER_PARAM = 16
LOGITS_BYTES = 4  # the loss is computed on float32 logits
HEAP_SLACK = 0.5  # the host heap's slack as a fraction of a step's transient memory (estimate_peak)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank of each part; `total` is their sum."""

    parameters: int  # weights, gradients and optimizer state (this rank's shard)
    activations: int  # saved for backward by one microbatch
    attention_mask: int  # one microbatch's boolean document mask

    @property
    def total(self) -> int:
        return self.parameters + self.activations + self.attention_mask

    def describe(self) -> str:
        return (f"{format_bytes(self.total)} (parameters + optimizer {format_bytes(self.parameters)}, "
                f"activations {format_bytes(self.activations)}, attention mask {format_bytes(self.attention_mask)})")


def format_bytes(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def activation_elements_per_token(cfg: JobConfig) -> tuple[int, int, int]:
    """Elements saved per token: (a dense layer, an MoE layer, a layer's input alone)."""
    m, moe = cfg.model, cfg.model.moe
    head_dim = m.attention_head_dim()
    kv_heads = m.n_kv_heads or m.n_heads
    # Both norms' inputs and outputs, q, k, v and the attention output before wo.
    attention = 4 * m.dim + (2 * m.n_heads + 2 * kv_heads) * head_dim
    if m.kv_lora_rank is not None:  # MLA: q and k of qk_nope + qk_rope, v and the output of v_head_dim, the latents
        qk_head = m.qk_nope_head_dim + m.qk_rope_head_dim
        latents = m.kv_lora_rank + m.qk_rope_head_dim + (m.q_lora_rank or 0)
        attention = 4 * m.dim + m.n_heads * (2 * qk_head + 2 * m.v_head_dim) + latents
    dense_ffn = 3 * m.ffn_hidden  # w1 and w3 outputs, their gated product
    w1_width = 2 * moe.expert_hidden if moe.activation == "swiglu" else moe.expert_hidden
    moe_ffn = moe.n_experts + moe.top_k * w1_width + 3 * moe.expert_hidden * moe.n_shared_experts
    return attention + dense_ffn, attention + moe_ffn, m.dim


def estimate_training_memory(cfg: JobConfig, dp_shard: int = 1) -> MemoryEstimate:
    """Bytes per rank to train `cfg` with parameters sharded over `dp_shard` ranks."""
    m, t = cfg.model, cfg.train
    weights, gradients, optimizer = _state_bytes(cfg, dp_shard)
    parameters = weights + gradients + optimizer
    # A microbatch is microbatch_size rows of seq_len tokens, or one row of up to data.token_budget tokens.
    if cfg.data.batching == "token_budget":
        rows, row_len = 1, cfg.data.token_budget or cfg.data.seq_len
    else:
        rows, row_len = t.microbatch_size, cfg.data.seq_len
    tokens = rows * row_len // (cfg.parallel.cp * cfg.parallel.tp)  # a rank's share of the per-token work
    dense, moe, layer_input = activation_elements_per_token(cfg)
    probs = _gemm_attention_probs_per_token(cfg, rows, row_len, "cpu")
    dense, moe = dense + probs, moe + probs
    n_dense, n_moe = m.n_dense_layers, m.n_layers - m.n_dense_layers
    if t.activation_checkpointing not in (False, "none"):  # full or selective (estimated as full)
        per_token = m.n_layers * layer_input + (moe if n_moe else dense)
    else:
        per_token = n_dense * dense + n_moe * moe
    act_bytes = DTYPE_BYTES[cfg.parallel.param_dtype]
    activations = tokens * (per_token * act_bytes + 2 * m.vocab_size * LOGITS_BYTES)
    # torch.bool: one byte per element; under CP the tiled attention builds tile-sized masks only.
    attention_mask = rows * row_len ** 2 if cfg.parallel.cp == 1 else 0
    return MemoryEstimate(parameters, activations, attention_mask)


@dataclass(frozen=True)
class MemoryBreakdown:
    """The parts of a rank's training memory, in bytes, as `moetrain estimate` reports them."""

    weights: int  # float32 master weights (this rank's shard)
    gradients: int  # float32 gradients (this rank's shard)
    optimizer: int  # AdamW's exp_avg and exp_avg_sq (this rank's shard)
    activations: int  # saved for backward by one microbatch, without activation checkpointing
    activations_checkpointed: int  # the same with train.activation_checkpointing = True
    attention_mask: int  # one microbatch's boolean document mask

    def peak(self, activation_checkpointing: bool) -> int:
        saved = self.activations_checkpointed if activation_checkpointing else self.activations
        return self.weights + self.gradients + self.optimizer + saved + self.attention_mask


def tp_replicated_params(m: ModelConfig) -> int:
    """Parameters tensor parallelism keeps whole on every TP rank (moetrain.parallel.tensor_parallel): the
    RMSNorms, per-head QK-norm weights, the routers and the shared expert's gate, MLA's low-rank projections
    (wq_a, wkv_a) and their norms. Everything else is split over the TP ranks: heads, FFN widths, the
    vocabulary, and the routed experts through their FSDP mesh (efsdp x cp x tp)."""
    moe = m.moe
    per_layer = 2 * m.dim + (2 * m.attention_head_dim() if m.qk_norm == "per_head" else 0)
    if m.kv_lora_rank is not None:
        per_layer += m.dim * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
        per_layer += (m.dim + 1) * m.q_lora_rank if m.q_lora_rank else 0
    router = m.dim * moe.n_experts + (moe.n_experts if moe.router_bias else 0) + (
        m.dim if moe.shared_expert_gate else 0)
    return m.dim + m.n_layers * per_layer + (m.n_layers - m.n_dense_layers) * router


def rank_params(cfg: JobConfig, params: int, replicated: int, dp_shard: int) -> int:
    """Of `params` parameters (`replicated` of them whole on every TP rank), those one rank stores: FSDP shards
    over dp_shard x cp (the CP ranks folded into the shard dimension), tensor parallelism splits the rest."""
    shard = max(dp_shard, 1) * cfg.parallel.cp
    return (params - replicated) // (shard * cfg.parallel.tp) + replicated // shard


def muon_params(cfg: JobConfig) -> int:
    """Parameters Muon updates under `train.optimizer = "muon"` (0 under AdamW): the weight matrices and expert
    stacks of `train.muon_groups` (moetrain.train.optim's choice; 1-D parameters and expert biases stay on AdamW)."""
    if cfg.train.optimizer != "muon":
        return 0
    m, moe = cfg.model, cfg.model.moe
    n_moe = m.n_layers - m.n_dense_layers
    w1_width = moe.expert_hidden if moe.activation == "gelu" else 2 * moe.expert_hidden
    matrices = {
        "attention": m.n_layers * _attention_params(m)[0],
        "dense_ffn": 3 * m.dim * (m.n_dense_layers * m.ffn_hidden + n_moe * moe.shared_width()),
        "experts": n_moe * moe.n_experts * (m.dim * w1_width + moe.expert_hidden * m.dim),
        "router": n_moe * m.dim * (moe.n_experts + (1 if moe.shared_expert_gate else 0)),
        "embeddings": m.vocab_size * m.dim,
        "head": 0 if m.tie_embeddings else m.vocab_size * m.dim,
    }
    return sum(matrices.get(group, 0) for group in set(cfg.train.muon_groups))


def optimizer_state_bytes(cfg: JobConfig, params: int) -> int:
    """Optimizer state of `params` parameters of the model (a rank's shard or stage): AdamW's 2 float32 moments
    each, except Muon's matrices, 1 float32 momentum buffer each (their share of the whole model)."""
    total = count_params(cfg.model)["total"]
    return 8 * params - 4 * params * muon_params(cfg) // max(total, 1)


def optimizer_label(cfg: JobConfig) -> str:
    """What `moetrain estimate` says the optimizer state is."""
    if cfg.train.optimizer != "muon":
        return "AdamW: 2 float32 moments; fused step, no temporaries"
    return (f"Muon: 1 float32 momentum buffer on its {muon_params(cfg) / 1e6:.2f} M matrix parameters "
            f"({', '.join(cfg.train.muon_groups)}), AdamW's 2 moments on the rest")


def _state_bytes(cfg: JobConfig, dp_shard: int) -> tuple[int, int, int]:
    """(weights, gradients, optimizer state) bytes of this rank's shard; under LoRA a frozen base in the compute
    dtype plus float32 adapters, their gradients and AdamW's moments of the adapters only."""
    shard = rank_params(cfg, count_params(cfg.model)["total"], tp_replicated_params(cfg.model), dp_shard)
    adapters = rank_params(cfg, adapter_count(cfg.model, cfg.lora), 0, dp_shard)
    if not adapters:
        return 4 * shard, 4 * shard, optimizer_state_bytes(cfg, shard)
    return shard * DTYPE_BYTES[cfg.parallel.param_dtype] + 4 * adapters, 4 * adapters, 8 * adapters


def _folded_experts_bytes(cfg: JobConfig) -> int:
    """One MoE layer's folded expert weights and their gradient in backward, with routed-expert adapters."""
    m, moe = cfg.model, cfg.model.moe
    if not cfg.lora.enabled or "experts" not in cfg.lora.targets or m.n_dense_layers == m.n_layers:
        return 0
    width = moe.expert_hidden if moe.activation == "gelu" else 2 * moe.expert_hidden
    stack = moe.n_experts // max(cfg.parallel.ep, 1) * m.dim * (width + moe.expert_hidden)
    return 2 * stack * DTYPE_BYTES[cfg.parallel.param_dtype]


def training_memory_breakdown(cfg: JobConfig, dp_shard: int = 1) -> MemoryBreakdown:
    """estimate_training_memory's parts: weights, gradients and optimizer state apart, activations both ways."""
    weights, gradients, optimizer = _state_bytes(cfg, dp_shard)
    with_ac = replace(cfg, train=replace(cfg.train, activation_checkpointing=True))
    without_ac = replace(cfg, train=replace(cfg.train, activation_checkpointing=False))
    full, checkpointed = estimate_training_memory(without_ac, dp_shard), estimate_training_memory(with_ac, dp_shard)
    return MemoryBreakdown(weights=weights, gradients=gradients, optimizer=optimizer,
                           activations=full.activations, activations_checkpointed=checkpointed.activations,
                           attention_mask=full.attention_mask)


# ---------------------------------------------------------------------------------------------------
# The peak a rank really reaches: `estimate_training_memory` above is a lower bound (what certainly gets
# allocated, so that a refusal is never a false alarm); `estimate_peak` below is the best estimate of the
# peak resident memory, for `moetrain estimate` and `train --dry-run`. Its two terms that depend on the
# machine (the process itself and the loaded data) are measured by the caller and passed in: this module
# still never looks at the machine.


@dataclass(frozen=True)
class PeakEstimate:
    """Bytes per rank at the peak of a training step, by part; `peak` is the larger of the two phases."""

    process: int  # the interpreter, torch, moetrain and their libraries (measured by the caller)
    data: int  # the training and held-out tokens held in memory (measured by the caller; 0 = not counted)
    weights: int  # float32 master weights (this rank's shard)
    gradients: int  # float32 gradients (this rank's shard)
    optimizer: int  # AdamW's exp_avg and exp_avg_sq (this rank's shard)
    activations: int  # saved for backward by one microbatch, at the configured activation checkpointing
    backward_working: int  # one block's activation gradients (and its recomputation under checkpointing)
    logits: int  # float32 logits, log-softmax and its gradient of one microbatch
    attention_mask: int  # one microbatch's document mask (boolean; the dense method's float32 copies too)
    fsdp_buffers: int  # two blocks' unsharded parameters (one prefetched) and one block's unsharded gradients
    optimizer_temporaries: int  # the optimizer step's temporaries (fused AdamW: none)
    allocator: int  # memory the host allocator keeps that no live tensor uses (see estimate_peak)
    expert_weights: int = 0  # the part of `weights` that is routed experts (this rank's E/ep, FSDP-sharded)
    expert_exchange: int = 0  # part of `activations`: the rows expert parallelism brings in, kept for backward

    @property
    def step_peak(self) -> int:
        """During forward and backward: everything but the optimizer's temporaries."""
        return (self.process + self.data + self.weights + self.gradients + self.optimizer + self.activations
                + self.backward_working + self.logits + self.attention_mask + self.fsdp_buffers + self.allocator)

    @property
    def optimizer_peak(self) -> int:
        """During the optimizer step: the state and its temporaries, the activations gone."""
        return (self.process + self.data + self.weights + self.gradients + self.optimizer
                + self.optimizer_temporaries)

    @property
    def peak(self) -> int:
        return max(self.step_peak, self.optimizer_peak)


def _gemm_attention_probs_per_token(cfg: JobConfig, rows: int, row_len: int, device_type: str) -> int:
    """Probabilities the CPU GEMM attention (attention.py) saves per token and layer, counted for rows of one
    document ("dense", "auto" on rows it resolves to plain causal); 0 for "segments" (documents shorter than
    the row: a lower bound), "flex", MLA, and calls above the GEMM path's size bound, which take SDPA."""
    m = cfg.model
    if m.kv_lora_rank is not None or m.attention not in ("auto", "dense"):
        return 0
    keys = gemm_attention_saved_keys(rows, m.n_heads, row_len, DTYPES[cfg.parallel.param_dtype], device_type)
    return int(m.n_heads * keys)


def _attention_saved_per_token(cfg: JobConfig, device_type: str, rows: int = 1, row_len: int = 0) -> int:
    """Elements one attention sub-block saves per token, both norms included (counted per storage with
    saved_tensors_hooks on tiny_moe and qwen3_moe_debug shapes; tests/unit/test_peak_estimate.py)."""
    m = cfg.model
    head_dim = m.attention_head_dim()
    heads, kv_heads = m.n_heads, m.n_kv_heads or m.n_heads
    saved = 5 * m.dim  # both RMSNorms' inputs and outputs, and the input of the q/k/v projections
    if m.kv_lora_rank is not None:  # MLA: q and k of qk_nope + qk_rope, v and the output of v_head_dim, the latents
        qk_head = m.qk_nope_head_dim + m.qk_rope_head_dim
        latents = m.kv_lora_rank + m.qk_rope_head_dim + (m.q_lora_rank or 0)
        return saved + heads * (2 * qk_head + 2 * m.v_head_dim) + 2 * latents + heads * m.v_head_dim
    if m.qk_norm != "none":  # the QK-norms' inputs and outputs (RoPE itself saves only cos and sin)
        saved += 2 * (heads + kv_heads) * head_dim
    method = m.attention if m.attention != "auto" else ("flex" if device_type == "cuda" else "segments")
    if method == "flex" or cfg.parallel.cp > 1:  # q, k, v as they are, the output and its log-sum-exp (flex's,
        # or the tiled attention's under CP, which keeps only this rank's k and v)
        return saved + (2 * heads + 2 * kv_heads) * head_dim + heads
    probs = _gemm_attention_probs_per_token(cfg, rows, row_len, device_type)
    if probs:  # the GEMM attention: its copies of q, k and v, the output and the saved probabilities
        return saved + (2 * heads + 2 * kv_heads) * head_dim + probs
    # SDPA (dense, segments, causal rows): q, k and v with k and v repeated to every query head, the output;
    # per-document segments keep the output scattered back to the rows as well (wo's input).
    return saved + 4 * heads * head_dim + (heads * head_dim if method == "segments" else 0)


def _ffn_saved_per_token(cfg: JobConfig, moe_layer: bool) -> int:
    m, moe = cfg.model, cfg.model.moe
    if not moe_layer:
        return m.dim + 4 * m.ffn_hidden  # input, w1 and w3 outputs, silu(w1 x), their product
    w1_width = 2 * moe.expert_hidden if moe.activation == "swiglu" else moe.expert_hidden
    # Router input (the experts' X too), probabilities and the pre-activation H of every routed copy
    # (moe_function.py); standard autograd ("grouped", "loop") also keeps the gathered rows, phi(H) and
    # the expert outputs.
    saved = m.dim + moe.n_experts + moe.top_k * w1_width
    if moe.impl != "memory_efficient":
        saved += moe.top_k * (2 * m.dim + moe.expert_hidden)
    return saved + (m.dim + 4 * moe.shared_width()) * min(moe.n_shared_experts, 1)


def _row_length(cfg: JobConfig) -> int:
    return (cfg.data.token_budget or cfg.data.seq_len) if cfg.data.batching == "token_budget" else cfg.data.seq_len


def estimate_peak(cfg: JobConfig, dp_shard: int = 1, device_type: str = "cpu", process_bytes: int = 0,
                  data_bytes: int = 0, activation_checkpointing: bool | None = None,
                  host_heap: bool = False) -> PeakEstimate:
    """The peak bytes of a rank of `cfg` sharded over `dp_shard`; `process_bytes`, `data_bytes` measured.

    `host_heap` (a CPU job): the host heap's slack, memory it holds that no live tensor uses (freed
    forward temporaries between saved tensors, the state first allocated in the first step's freed
    activation space), is taken as HEAP_SLACK of the step's transient memory (activations, backward working
    set, logits). That fraction is measured, not derived: the slack was 0.13x (olmoe_tiny), 0.5x (tiny_moe)
    and 1.1x (qwen3_moe_debug) of the transients on one process (benchmarks/profile/estimate_accuracy.py)."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    ac = (t.activation_checkpointing not in (False, "none")) if activation_checkpointing is None \
        else activation_checkpointing
    counts = count_params(m)
    rows = 1 if cfg.data.batching == "token_budget" else t.microbatch_size
    # A rank's share of the microbatch's per-token work: CP splits the sequence, TP the heads and widths (and,
    # between them, the sequence: sequence parallelism). TP's projections also save their gathered input,
    # [B, S / cp, d], once per attention, dense FFN and shared expert (`gathered` tokens more than the share).
    tokens = rows * _row_length(cfg) // (p.cp * p.tp)
    gathered = rows * _row_length(cfg) // p.cp - tokens
    act_bytes = DTYPE_BYTES[p.param_dtype]
    attention = _attention_saved_per_token(cfg, device_type, rows, _row_length(cfg))
    dense_layer = attention + _ffn_saved_per_token(cfg, moe_layer=False)
    moe_layer = attention + _ffn_saved_per_token(cfg, moe_layer=True)
    n_dense, n_moe = m.n_dense_layers, m.n_layers - m.n_dense_layers
    largest_layer = moe_layer if n_moe else dense_layer
    final_norm = 3 * m.dim  # the final norm's input, output and the head's input
    tp_inputs = 0 if p.tp == 1 else m.dim * (m.n_layers + n_dense + (n_moe if m.moe.n_shared_experts else 0))
    if ac:  # each block's input; one block recomputed at a time (counted in backward_working)
        saved, gathered_saved = m.n_layers * m.dim + final_norm, 0
        working = 2 * largest_layer
    else:
        saved, gathered_saved = n_dense * dense_layer + n_moe * moe_layer + final_norm, tp_inputs
        working = largest_layer  # the gradients of the block whose backward runs
    logits = 3 * tokens * m.vocab_size * LOGITS_BYTES  # logits, log-softmax, their gradient (vocabulary split by TP)
    # The boolean document mask, built once per forward; the dense method also keeps a float32 copy per layer.
    # Under CP the tiled attention builds tile-sized masks only; it gathers the whole rows' keys and values in
    # float32 (forward, and again in backward beside their gradients' accumulator) and holds a few tiles' scores.
    mask = rows * _row_length(cfg) ** 2 * (1 + (4 * m.n_layers if m.attention == "dense" else 0)) if p.cp == 1 else 0
    context = 0 if p.cp == 1 else 2 * rows * _row_length(cfg) * kv_width(m) // p.tp * 4 + 4 * TILE_SCORES * 4
    fsdp = _fsdp_buffer_bytes(cfg, counts, dp_shard, act_bytes)
    exchange = 0
    if cfg.parallel.ep > 1 and n_moe and not ac:  # the experts' input is the received rows, not the layer's
        exchange = n_moe * tokens * m.moe.top_k * (m.dim + 1) * act_bytes
    activations = tokens * saved * act_bytes + gathered * gathered_saved * act_bytes + exchange
    backward_working = tokens * working * act_bytes + _folded_experts_bytes(cfg) + context
    transients = activations + backward_working + logits
    allocator = int(HEAP_SLACK * transients) if host_heap else 0
    weights, gradients, optimizer = _state_bytes(cfg, dp_shard)
    return PeakEstimate(process=process_bytes, data=data_bytes, weights=weights, gradients=gradients,
                        optimizer=optimizer, activations=activations, backward_working=backward_working,
                        logits=logits, attention_mask=mask, fsdp_buffers=fsdp, optimizer_temporaries=0,
                        allocator=allocator,
                        expert_weights=4 * (_expert_params(cfg) // (max(dp_shard, 1) * p.cp * p.tp)),
                        expert_exchange=exchange)


def _expert_params(cfg: JobConfig) -> int:
    """Routed expert parameters of the whole model, their biases included."""
    moe = cfg.model.moe
    w1_width = moe.expert_hidden if moe.activation == "gelu" else 2 * moe.expert_hidden
    bias = (w1_width + cfg.model.dim) if moe.expert_proj_bias else 0
    n_moe = cfg.model.n_layers - cfg.model.n_dense_layers
    return count_params(cfg.model)["routed_experts"] + n_moe * moe.n_experts * bias


def _fsdp_buffer_bytes(cfg: JobConfig, counts: dict[str, int], dp_shard: int, act_bytes: int) -> int:
    """FSDP2's unsharded parameters of two blocks (one prefetched) and unsharded gradients of one.

    Under expert parallelism a block's all-gather covers its non-expert parameters and only this rank's
    E/ep experts, over the dp_shard/ep ranks that hold them (none when those are this rank alone).
    """
    m, p = cfg.model, cfg.parallel
    if dp_shard * p.cp * p.tp <= 1:
        return 0
    embedding = m.vocab_size * m.dim * (1 if m.tie_embeddings else 2)
    experts = _expert_params(cfg)
    n_moe = m.n_layers - m.n_dense_layers
    ep = max(p.ep, 1)
    # A block's unsharded parameters on a TP rank: its split ones 1/tp (replicated norms and routers neglected).
    per_block = (counts["total"] - embedding - experts) // max(m.n_layers, 1) // p.tp
    if n_moe and dp_shard // ep * p.cp * p.tp > 1:  # experts are FSDP-sharded over efsdp x cp x tp
        per_block += experts // (n_moe * ep)
    per_block = max(per_block, m.vocab_size * m.dim // p.tp)
    return 2 * per_block * act_bytes + per_block * DTYPE_BYTES[cfg.parallel.reduce_dtype]


def kv_width(m: ModelConfig) -> int:
    """Elements of one token's keys and values over all heads, as attention gets them (MLA: per-head keys and
    values padded to one width)."""
    if m.kv_lora_rank is not None:
        return 2 * m.n_heads * max(m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim)
    return 2 * (m.n_kv_heads or m.n_heads) * m.attention_head_dim()


@dataclass(frozen=True)
class SequenceSplitTraffic:
    """What tensor (`parallel.tp`) and context (`parallel.cp`) parallelism send per rank and step, in bytes.

    Closed forms of the plans in moetrain.parallel.tensor_parallel and context_parallel, over the step's
    train.grad_accum microbatches, forward and backward, activations in parallel.param_dtype: TP all-gathers
    the sequence-sharded stream before attention, the dense FFN and the shared expert and reduce-scatters
    after them, and once each for the embedding and the LM head, all mirrored in backward; CP all-gathers
    every layer's keys and values in forward, again in backward (they are not saved) and reduce-scatters
    their gradients. Each counts the (n - 1) / n share of a collective a rank receives.
    """

    tokens_per_rank: int  # of a microbatch's B x S tokens, the ones this rank's per-token work covers
    tp_bytes: int
    cp_bytes: int


def sequence_split_traffic(cfg: JobConfig) -> SequenceSplitTraffic:
    m, p = cfg.model, cfg.parallel
    rows, seq = cfg.train.microbatch_size, cfg.data.seq_len
    element = DTYPE_BYTES[p.param_dtype]
    micro = max(cfg.train.grad_accum, 1)
    stream = rows * seq // p.cp * m.dim * element  # the [B, S / cp, d] stream one TP collective moves
    shared = m.moe.n_shared_experts > 0
    collectives = 2 + sum(2 + (2 if i < m.n_dense_layers or shared else 0) for i in range(m.n_layers))
    tp_bytes = micro * 2 * collectives * stream * (p.tp - 1) // p.tp
    cp_bytes = micro * 3 * m.n_layers * rows * seq * kv_width(m) // p.tp * element * (p.cp - 1) // p.cp
    return SequenceSplitTraffic(rows * seq // (p.cp * p.tp), tp_bytes, cp_bytes)
