"""What a job needs per rank before it runs, for a mesh the user may not have, and its report.

`estimate` gives total and active parameters and per rank the bytes of weights, gradients,
optimizer state, activations with and without activation checkpointing, the backward's working set,
logits, FSDP buffers and the peak (moetrain.model.memory_estimate.estimate_peak), compared with the
memory of CPU ranks on this machine, of this machine's GPU or of a named one; `describe` is the
report `moetrain estimate` and `moetrain train --dry-run` print (the dry run exits 2 in one line when
the peak does not fit: `Estimate.refusal`). On CPU two terms are measured in this process: its own
resident memory (the same interpreter, torch and moetrain modules a rank loads) and what loading the
job's training data adds. `job_defaults` is the starting point of a job with `model.init_from =
"hf:DIR"`. It reads the config (and DIR's config.json) and, on CPU, the data; it builds no model,
parses no command line and writes nothing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from moetrain.config.job import JobConfig
from moetrain.config.lora import adapter_count
from moetrain.config.parallel import check_world_size
from moetrain.data.dataset import load_training_data
from moetrain.errors import ConfigError
from moetrain.interop import hf_dir, hf_job_config
from moetrain.model.flops import count_params
from moetrain.model.memory_estimate import (
    PeakEstimate,
    estimate_peak,
    estimate_training_memory,
    format_bytes,
    optimizer_label,
    sequence_split_traffic,
)
from moetrain.observe.peak_memory import current_rss_bytes
from moetrain.runtime.preflight import physical_memory_bytes
from moetrain.train.pipeline_estimate import describe_layouts, pipeline_peak, propose_layouts

PROG = "moetrain estimate"
EXPERT_PARTS = ("expert_weights", "expert_exchange")  # inside `weights` and `activations`, shown apart
# Nominal memory of common accelerators (vendor datasheets), for a mesh the user does not have.
GPU_MEMORY_BYTES = {
    "A100-40GB": 40 * 2**30, "A100-80GB": 80 * 2**30, "H100": 80 * 2**30, "H200": 141 * 10**9,
    "B200": 180 * 10**9, "L4": 24 * 2**30, "L40S": 48 * 2**30, "RTX4090": 24 * 2**30, "MI300X": 192 * 2**30,
}


def job_defaults(init_from: str) -> JobConfig:
    """The defaults of a job that starts from `model.init_from = "hf:DIR"`: DIR's architecture and tokenizer."""
    return hf_job_config(hf_dir(init_from))


def _memory_of(device: str, device_memory: str | None, per_node: int) -> tuple[int | None, int, str]:
    """(bytes a rank's share has, ranks sharing them, where) for 'cpu', a named GPU or --device-memory GiB."""
    if device_memory is not None:
        try:
            gib = float(device_memory)
        except ValueError:
            gib = -1.0
        if not gib > 0:
            raise ConfigError(f"--device-memory = {device_memory!r} is invalid: a positive number of GiB")
        return int(gib * 2**30), 1, f"{device} with {format_bytes(gib * 2**30)} (--device-memory)"
    if device == "cuda":  # this machine's GPU (the first; ranks of one job get the same kind)
        if not torch.cuda.is_available():
            raise ConfigError("--device = 'cuda' is invalid here: no CUDA device is visible; name a GPU "
                              f"({', '.join(GPU_MEMORY_BYTES)}) or give --device-memory GIB")
        props = torch.cuda.get_device_properties(0)
        return props.total_memory, 1, f"this machine's {props.name}: {format_bytes(props.total_memory)}"
    if device == "cpu":
        available = physical_memory_bytes()
        return available, per_node, f"this machine's {format_bytes(available or 0)} shared by {per_node} rank(s)"
    if device not in GPU_MEMORY_BYTES:
        raise ConfigError(f"--device = {device!r} is invalid: 'cpu', 'cuda' (this machine's GPU) or one of "
                          f"{', '.join(GPU_MEMORY_BYTES)} (or any name with --device-memory GIB)")
    return GPU_MEMORY_BYTES[device], 1, f"{device}: {format_bytes(GPU_MEMORY_BYTES[device])}"


def process_baseline_bytes() -> int:
    """This process's resident memory now: the same interpreter, torch and moetrain modules a rank loads."""
    return current_rss_bytes()


def measure_data_bytes(cfg: JobConfig) -> int:
    """The resident memory loading `cfg`'s training data adds to this process (what a rank holds all run)."""
    before = current_rss_bytes()
    data = load_training_data(cfg)
    held = current_rss_bytes() - before  # measured while the data is still referenced
    del data
    return max(held, 0)


@dataclass(frozen=True)
class Estimate:
    """What `moetrain estimate` reports for a job and a mesh; `fits` is None when the memory is unknown."""

    cfg: JobConfig
    world: int
    per_node: int
    device: str
    replicate: int
    shard: int
    peak: PeakEstimate  # at the configured train.activation_checkpointing
    other: PeakEstimate  # at the other setting
    lower_bound: int  # what certainly gets allocated (the start's refusal threshold, runtime.preflight)
    available: int | None
    sharers: int
    where: str

    @property
    def fits(self) -> bool | None:
        return None if self.available is None else self.peak.peak * self.sharers <= self.available

    def refusal(self) -> str:
        """The one line a dry run that does not fit ends with."""
        ac = self.cfg.train.activation_checkpointing
        hint = "" if ac or self.other.peak >= self.peak.peak else \
            f"; with train.activation_checkpointing = True it is {format_bytes(self.other.peak)}"
        return (f"this job's estimated peak is {format_bytes(self.peak.peak)} per rank on {self.world} rank(s), "
                f"more than {self.where}{hint}; lower train.microbatch_size or data.seq_len, or shard over "
                "more ranks (moetrain estimate shows the parts)")

    def as_json(self) -> dict:
        return {"world": self.world, "per_node": self.per_node, "device": self.device,
                "replicate": self.replicate, "shard": self.shard, "peak_bytes": self.peak.peak,
                "parts": {k: v for k, v in asdict(self.peak).items() if k not in EXPERT_PARTS},
                # parts of the weights and the activations above: what expert parallelism leaves on this rank
                "experts": {"weights_bytes": self.peak.expert_weights, "exchange_bytes": self.peak.expert_exchange},
                "step_peak_bytes": self.peak.step_peak,
                "optimizer_peak_bytes": self.peak.optimizer_peak,
                "other_activation_checkpointing_peak_bytes": self.other.peak,
                "lower_bound_bytes": self.lower_bound, "available_bytes": self.available, "fits": self.fits,
                "parameters": count_params(self.cfg.model),
                "sequence_split": asdict(sequence_split_traffic(self.cfg))}


def estimate(cfg: JobConfig, world: int, per_node: int, device: str, device_memory: str | None = None,
             process_bytes: int | None = None, data_bytes: int | None = None) -> Estimate:
    """The estimate; on CPU the process and data terms are measured here unless given."""
    available, sharers, where = _memory_of(device, device_memory, per_node)
    replicate, shard = check_world_size(cfg.parallel, world)
    host = device == "cpu"
    if host:  # on a GPU the interpreter and the data live in host memory, not in the device's
        process_bytes = process_baseline_bytes() if process_bytes is None else process_bytes
        data_bytes = measure_data_bytes(cfg) if data_bytes is None else data_bytes
    else:
        process_bytes = data_bytes = 0
    device_type = "cpu" if host else "cuda"
    ac = cfg.train.activation_checkpointing not in (False, "none")
    if cfg.parallel.pp > 1:  # the heaviest pipeline rank: its layers, the microbatches its schedule keeps in flight
        peak = pipeline_peak(cfg, shard, device_type, process_bytes, data_bytes, ac, host)[0]
        other = pipeline_peak(cfg, shard, device_type, process_bytes, data_bytes, not ac, host)[0]
    else:
        peak = estimate_peak(cfg, shard, device_type, process_bytes, data_bytes, ac, host_heap=host)
        other = estimate_peak(cfg, shard, device_type, process_bytes, data_bytes, not ac, host_heap=host)
    return Estimate(cfg, world, per_node, device, replicate, shard, peak, other,
                    estimate_training_memory(cfg, shard * cfg.parallel.pp).total, available, sharers, where)


def proposals(cfg: JobConfig, world: int, per_node: int, device: str, device_memory: str | None = None) -> str:
    """The pipeline, data and expert layouts of `world` ranks that fit the device, ranked (GPU devices only:
    on CPU the ranks share one machine's memory and the measured process terms dominate)."""
    available, sharers, where = _memory_of(device, device_memory, per_node)
    if device == "cpu" or available is None:
        raise ConfigError("--propose is invalid with --device cpu: name a GPU or give --device-memory GIB")
    return describe_layouts(propose_layouts(cfg, world, per_node, available // sharers, "cuda"), where)


def report(cfg: JobConfig, world: int, per_node: int, device: str, device_memory: str | None = None,
           process_bytes: int | None = None, data_bytes: int | None = None) -> str:
    """The estimate as lines of text; ConfigError when the mesh does not fit the world or the device is unknown."""
    return describe(estimate(cfg, world, per_node, device, device_memory, process_bytes, data_bytes))


def _microbatch_words(cfg: JobConfig) -> str:
    """The microbatch the activations were counted for, in the config's own words."""
    if cfg.data.batching == "token_budget":
        return (f"one row of {cfg.data.token_budget or cfg.data.seq_len} tokens per microbatch (data.batching = "
                f"'token_budget', data.token_budget), train.grad_accum {cfg.train.grad_accum}")
    return (f"train.microbatch_size {cfg.train.microbatch_size} x data.seq_len {cfg.data.seq_len} tokens per "
            f"microbatch, train.grad_accum {cfg.train.grad_accum}")


def _expert_rows(est: Estimate) -> list[str]:
    """What expert parallelism changes: whose experts a rank holds and gathers, the rows it receives."""
    cfg, parts = est.cfg, est.peak
    moe, ep = cfg.model.moe, cfg.parallel.ep
    if cfg.model.n_layers == cfg.model.n_dense_layers:
        return []
    rows = [f"      experts       {format_bytes(parts.expert_weights):>12}  (of the weights: {moe.n_experts // ep} of "
            f"{moe.n_experts} experts per MoE layer on this rank (ep {ep}), FSDP-sharded over "
            f"{max(est.shard // ep, 1) * cfg.parallel.cp * cfg.parallel.tp} rank(s); their gradients and optimizer "
            "state alike)"]
    if parts.expert_exchange:
        rows.append(f"      exchanged     {format_bytes(parts.expert_exchange):>12}  (of the activations: the rows "
                    "the experts receive by all-to-all, kept for backward)")
    return rows


def _pipeline(cfg: JobConfig) -> str:
    parallel = cfg.parallel
    if parallel.pp == 1:
        return ""
    return (f"pp {parallel.pp} {parallel.pp_schedule} x {parallel.pp_stages_per_rank} stage(s) per rank, "
            "the heaviest pipeline rank shown; ")


def describe(est: Estimate) -> str:
    cfg, parts, shard = est.cfg, est.peak, est.shard
    params = count_params(cfg.model)
    ac = cfg.train.activation_checkpointing
    with_ac, without_ac = (parts, est.other) if ac else (est.other, parts)
    verdict = "unknown" if est.fits is None else ("fits" if est.fits else "does NOT fit")
    host = est.device == "cpu"
    rows = [
        f"{PROG}: {est.world} rank(s) ({_pipeline(cfg)}{est.replicate} replica(s) x {shard} shard(s), "
        f"ep {cfg.parallel.ep}), "
        f"{est.per_node} per machine, device {est.device}",
        f"  parameters        {params['total'] / 1e6:12.2f} M total, {params['active'] / 1e6:.2f} M active per token",
        f"  assumed           {_microbatch_words(cfg)}",
        "  per rank:",
    ]
    if host:
        rows += [
            f"    process         {format_bytes(parts.process):>12}  (measured: this interpreter after importing torch "
            "and moetrain, the same a rank loads)",
            f"    data            {format_bytes(parts.data):>12}  (measured: what loading the training data added "
            "here; 0 with --skip-data)",
        ]
    adapters = adapter_count(cfg.model, cfg.lora)
    if adapters:
        rows.insert(2, f"  LoRA              {adapters / 1e6:12.2f} M adapter parameters (rank {cfg.lora.rank}: "
                    f"{', '.join(cfg.lora.targets)}), the only ones with gradients and optimizer state")
        weights = (f"(the frozen base in {cfg.parallel.param_dtype} and float32 adapters, 1/{shard} of the model; "
                   "backward adds one layer's folded expert weights and their gradient)")
    elif cfg.parallel.cp * cfg.parallel.tp > 1:
        weights = (f"(float32: FSDP over dp_shard x cp = {shard * cfg.parallel.cp} ranks, and what TP splits "
                   f"1/{cfg.parallel.tp} of that)")
    else:
        weights = f"(float32, 1/{shard} of the model)"
    rows += [
        f"    weights         {format_bytes(parts.weights):>12}  "
        + (f"(float32, 1/{shard} of the rank's stages)" if cfg.parallel.pp > 1 else weights),
        *_expert_rows(est)[:1],
        f"    gradients       {format_bytes(parts.gradients):>12}",
        f"    optimizer       {format_bytes(parts.optimizer):>12}  ({optimizer_label(cfg)})",
        f"    activations     {format_bytes(without_ac.activations):>12}  without activation checkpointing",
        f"                    {format_bytes(with_ac.activations):>12}  with activation checkpointing",
        *_expert_rows(est)[1:],
        f"    backward        {format_bytes(parts.backward_working):>12}  (one block's activation gradients"
        f"{' and its recomputation' if ac else ''})",
        f"    logits          {format_bytes(parts.logits):>12}  (float32 logits, log-softmax and gradient)",
        f"    attention mask  {format_bytes(parts.attention_mask):>12}",
        f"    FSDP buffers    {format_bytes(parts.fsdp_buffers):>12}  "
        + ("(the stages' gathered parameters and unsharded gradients, held through the step)"
           if cfg.parallel.pp > 1 else "(unsharded parameters of 2 blocks, gradients of 1)"),
    ]
    if host:
        rows.append(f"    allocator       {format_bytes(parts.allocator):>12}  (the host heap's slack: half the "
                    "step's transients, as measured on the presets)")
    if cfg.parallel.tp > 1 or cfg.parallel.cp > 1:
        split = sequence_split_traffic(cfg)
        rows += [
            f"    TP/CP           tp {cfg.parallel.tp} x cp {cfg.parallel.cp}: {split.tokens_per_rank} of each "
            f"microbatch's {cfg.train.microbatch_size * cfg.data.seq_len} tokens per rank (weights, activations "
            "and logits above are this rank's share)",
            f"      TP traffic    {format_bytes(split.tp_bytes):>12}  per step (sequence gathers and "
            "reduce-scatters, forward and backward)",
            f"      CP traffic    {format_bytes(split.cp_bytes):>12}  per step (K/V gathers in forward and "
            "backward, their gradients' reduce-scatters)",
        ]
    rows += [
        f"    peak            {format_bytes(parts.peak):>12}  (train.activation_checkpointing = {ac}; other setting: "
        f"{format_bytes(est.other.peak)})",
        f"  {verdict} on {est.where}",
        f"  (what certainly gets allocated, the start's refusal threshold: {format_bytes(est.lower_bound)}"
        f"{'' if host else '; on a GPU the CUDA context and allocator cache come on top'})",
    ]
    return "\n".join(rows)
