"""`moetrain estimate --config C [overrides] [--world N | --nodes N --gpus-per-node G] [--device cpu|GPU]`.

What a job needs before it runs, for a mesh the user may not have: total and active parameters, and
per rank the bytes of weights, gradients, optimizer state, activations with and without activation
checkpointing, the backward's working set, logits, FSDP buffers and the peak
(moetrain.model.memory_estimate.estimate_peak), compared with the memory of CPU ranks on this machine,
of this machine's GPU or of a named one. `moetrain train --dry-run` prints the same report and exits 2
in one line when the peak does not fit. On CPU two terms are measured in this process: its own
resident memory (the same interpreter, torch and moetrain modules a rank loads) and what loading the
job's training data adds. It reads the config (and, with `model.init_from = "hf:DIR"`, DIR's
config.json) and, on CPU, the data; it builds no model and writes nothing.

This module parses the command line and prints the report; the estimate is moetrain.train.job_estimate.
"""

from __future__ import annotations

import json
import os

from moetrain.args import take_option
from moetrain.config.job import CommandOption, parse_job_args
from moetrain.errors import ConfigError
from moetrain.train.job_estimate import GPU_MEMORY_BYTES, PROG, describe, estimate, job_defaults, proposals

OPTIONS = (
    CommandOption("world", int | None, None, "ranks of the job; None = WORLD_SIZE of the environment, else 1"),
    CommandOption("nodes", int | None, None, "machines of the job (with --gpus-per-node; world = nodes x gpus)"),
    CommandOption("gpus_per_node", int | None, None, "ranks per machine (with --nodes)"),
    CommandOption("device", str, "cpu", f"'cpu' (this machine's memory shared by its ranks; the process and the "
                  f"data are measured here) or a GPU: {', '.join(GPU_MEMORY_BYTES)}"),
    CommandOption("device_memory", float | None, None, "GiB of one device, for a GPU not in the table "
                  "(overrides its entry)"),
    CommandOption("json", bool, False, "print the estimate as JSON (bytes) instead of the table"),
    CommandOption("propose", bool, False, "list the pp x dp_replicate x dp_shard x ep layouts of the world that fit "
                  "the GPU, fewest all-gather + all-to-all bytes per step first"),
    CommandOption("skip_data", bool, False, "on CPU, do not load the training data to measure it (data counts 0)"),
)


def _positive(value: str | None, name: str) -> int | None:
    if value is None:
        return None
    if not value.isdigit() or not 1 <= int(value) <= 1 << 24:  # 16 Mi ranks: beyond any cluster, a typo
        raise ConfigError(f"--{name.replace('_', '-')} = {value!r} is invalid: must be a positive integer <= 2**24")
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


def main(argv: list[str]) -> int:
    world_arg, argv = take_option(argv, "world")
    nodes_arg, argv = take_option(argv, "nodes")
    gpus_arg, argv = take_option(argv, "gpus-per-node")
    device, argv = take_option(argv, "device")
    device_memory, argv = take_option(argv, "device-memory")
    as_json, skip_data, propose = "--json" in argv, "--skip-data" in argv, "--propose" in argv
    argv = [a for a in argv if a not in ("--json", "--skip-data", "--propose")]
    cfg = parse_job_args(argv, prog=PROG, init_from_defaults=job_defaults, options=OPTIONS,
                         description=" ".join(__doc__.split("\n\n")[1].split()))
    world, per_node = mesh_size(_positive(world_arg, "world"), _positive(nodes_arg, "nodes"),
                                _positive(gpus_arg, "gpus_per_node"))
    if propose:
        if int(os.environ.get("RANK", "0")) == 0:
            print(proposals(cfg, world, per_node, device or "cpu", device_memory))
        return 0
    est = estimate(cfg, world, per_node, device or "cpu", device_memory, data_bytes=0 if skip_data else None)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, one report for the job
        print(json.dumps(est.as_json(), indent=1) if as_json else describe(est))
    return 0
