"""`moetrain estimate --config C [overrides] [--world N | --nodes N --gpus-per-node G] [--device cpu|GPU]`.

What a job needs before it runs, for a mesh the user may not have: total and active parameters, and
per rank the bytes of weights, gradients, optimizer state, activations with and without activation
checkpointing, the attention mask, and the peak (moetrain.model.memory_estimate), compared with the
memory of CPU ranks on this machine or of a named GPU. `moetrain train --dry-run` prints the same
report. It reads the config (and, with `model.init_from = "hf:DIR"`, DIR's config.json) only: it
builds no model, reads no data and writes nothing.
"""

from __future__ import annotations

import os

from moetrain.args import take_option
from moetrain.config import CommandOption, JobConfig, check_world_size, parse_job_args
from moetrain.errors import ConfigError
from moetrain.interop import hf_dir, hf_job_config
from moetrain.model.flops import count_params
from moetrain.model.memory_estimate import MemoryBreakdown, format_bytes, training_memory_breakdown
from moetrain.runtime.preflight import physical_memory_bytes

PROG = "moetrain estimate"
# Nominal memory of common accelerators (vendor datasheets), for a mesh the user does not have.
GPU_MEMORY_BYTES = {
    "A100-40GB": 40 * 2**30, "A100-80GB": 80 * 2**30, "H100": 80 * 2**30, "H200": 141 * 10**9,
    "B200": 180 * 10**9, "L4": 24 * 2**30, "L40S": 48 * 2**30, "RTX4090": 24 * 2**30, "MI300X": 192 * 2**30,
}
OPTIONS = (
    CommandOption("world", int | None, None, "ranks of the job; None = WORLD_SIZE of the environment, else 1"),
    CommandOption("nodes", int | None, None, "machines of the job (with --gpus-per-node; world = nodes x gpus)"),
    CommandOption("gpus_per_node", int | None, None, "ranks per machine (with --nodes)"),
    CommandOption("device", str, "cpu", f"'cpu' (this machine's memory shared by its ranks) or a GPU: "
                  f"{', '.join(GPU_MEMORY_BYTES)}"),
)


def job_defaults(init_from: str) -> JobConfig:
    """The defaults of a job that starts from `model.init_from = "hf:DIR"`: DIR's architecture and tokenizer."""
    return hf_job_config(hf_dir(init_from))


def _positive(value: str | None, name: str) -> int | None:
    if value is None:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"--{name.replace('_', '-')} = {value!r} is invalid: must be a positive integer")
    return int(value)


def mesh_size(world: int | None, nodes: int | None, gpus_per_node: int | None) -> tuple[int, int]:
    """(world size, ranks per machine) from --world or --nodes/--gpus-per-node (one line when both or half)."""
    if (nodes is None) != (gpus_per_node is None):
        raise ConfigError("--nodes and --gpus-per-node go together (world size = nodes x gpus per node)")
    if nodes is not None and gpus_per_node is not None:
        if world is not None and world != nodes * gpus_per_node:
            raise ConfigError(f"--world = {world} is invalid: --nodes {nodes} x --gpus-per-node {gpus_per_node} "
                              f"= {nodes * gpus_per_node}")
        return nodes * gpus_per_node, gpus_per_node
    world = world or int(os.environ.get("WORLD_SIZE", "1"))
    return world, world


def report(cfg: JobConfig, world: int, per_node: int, device: str) -> str:
    """The estimate as lines of text; ConfigError when the mesh does not fit the world or the device is unknown."""
    if device != "cpu" and device not in GPU_MEMORY_BYTES:
        raise ConfigError(f"--device = {device!r} is invalid: 'cpu' or one of {', '.join(GPU_MEMORY_BYTES)}")
    replicate, shard = check_world_size(cfg.parallel, world)
    params = count_params(cfg.model)
    parts: MemoryBreakdown = training_memory_breakdown(cfg, shard)
    ac = cfg.train.activation_checkpointing
    peak = parts.peak(ac)
    if device == "cpu":
        available, sharers = physical_memory_bytes(), per_node
        where = f"this machine's {format_bytes(available or 0)} shared by {per_node} rank(s)"
    else:
        available, sharers, where = GPU_MEMORY_BYTES[device], 1, f"{device}: {format_bytes(GPU_MEMORY_BYTES[device])}"
    verdict = "unknown" if available is None else ("fits" if peak * sharers <= available else "does NOT fit")
    rows = [
        f"{PROG}: {world} rank(s) ({replicate} replica(s) x {shard} shard(s), ep {cfg.parallel.ep}), "
        f"{per_node} per machine, device {device}",
        f"  parameters        {params['total'] / 1e6:12.2f} M total, {params['active'] / 1e6:.2f} M active per token",
        "  per rank:",
        f"    weights         {format_bytes(parts.weights):>12}  (float32, 1/{shard} of the model)",
        f"    gradients       {format_bytes(parts.gradients):>12}",
        f"    optimizer       {format_bytes(parts.optimizer):>12}  (AdamW: 2 float32 moments)",
        f"    activations     {format_bytes(parts.activations):>12}  without activation checkpointing",
        f"                    {format_bytes(parts.activations_checkpointed):>12}  with activation checkpointing",
        f"    attention mask  {format_bytes(parts.attention_mask):>12}",
        f"    peak            {format_bytes(peak):>12}  (train.activation_checkpointing = {ac}; other setting: "
        f"{format_bytes(parts.peak(not ac))})",
        f"  {verdict} on {where}",
        "  (counts what certainly gets allocated: no allocator slack, temporaries, FSDP gather buffers, "
        "data or the interpreter)",
    ]
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    world_arg, argv = take_option(argv, "world")
    nodes_arg, argv = take_option(argv, "nodes")
    gpus_arg, argv = take_option(argv, "gpus-per-node")
    device, argv = take_option(argv, "device")
    cfg = parse_job_args(argv, prog=PROG, init_from_defaults=job_defaults, options=OPTIONS,
                         description=" ".join(__doc__.split("\n\n")[1].split()))
    world, per_node = mesh_size(_positive(world_arg, "world"), _positive(nodes_arg, "nodes"),
                                _positive(gpus_arg, "gpus_per_node"))
    print(report(cfg, world, per_node, device or "cpu"))
    return 0
