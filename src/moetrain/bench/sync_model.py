"""`moetrain bench sync`'s instrumented networks and the inputs of one microbatch.

`ComputeClock` accumulates the seconds a rank spends in its own compute; the timed block
functions enter and leave it at the edges of each FSDP unit's math, so FSDP's
all-gathers and gradient reductions fall outside it. `build_model` returns the cost
model's network (the sleep/batch MLP or moetrain's dense Transformer for `packed`), and
`packed_shape`, `work_units`, `items_per_microbatch` and `microbatch_inputs` turn a drawn
cost into a microbatch. This module builds and feeds models: it must not create process
groups, run collectives or time whole steps.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from moetrain.bench.costs import as_batch_sizes
from moetrain.bench.sync_options import SyncBenchOptions
from moetrain.config.model import ModelConfig
from moetrain.model.transformer import Transformer

PACKED_VOCAB = 259


@dataclass
class ComputeClock:
    """This rank's compute: the drawn sleep of the current microbatch and the time spent computing.

    Blocks time the stretch between entering and leaving their own math, forward and
    backward, so FSDP's hooks (all-gather before, reduce-scatter/all-reduce after) fall
    outside it.
    """

    sleep_s: float = 0.0  # drawn seconds of the current microbatch (sleep model)
    forward_fraction: float = 1 / 3
    layers: int = 1
    busy_s: float = 0.0
    _entered: float | None = None

    def enter(self) -> None:
        self._entered = time.perf_counter()

    def leave(self) -> None:
        if self._entered is not None:
            self.busy_s += time.perf_counter() - self._entered
            self._entered = None

    def sleep_share(self, backward: bool) -> float:
        share = (1 - self.forward_fraction) if backward else self.forward_fraction
        return self.sleep_s * share / self.layers


class EnterBlock(torch.autograd.Function):
    """Identity that starts the clock in forward and stops it in backward (the block's entry)."""

    @staticmethod
    def forward(ctx, x, clock):
        ctx.clock = clock
        clock.enter()
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.leave()  # backward runs last through the block's entry
        return grad, None


class LeaveBlock(torch.autograd.Function):
    """Identity that stops the clock in forward and starts it in backward (the block's exit)."""

    @staticmethod
    def forward(ctx, x, clock):
        ctx.clock = clock
        clock.leave()
        return x.clone()  # not a view: FSDP registers its pre-backward hook on the block's output

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.enter()  # backward enters the block here
        return grad, None


class SleepShare(torch.autograd.Function):
    """Stands in for compute: sleeps its share of the drawn cost in forward and in backward."""

    @staticmethod
    def forward(ctx, x, clock):
        # The backward's share is taken now: under a pipeline schedule other microbatches run in between.
        ctx.backward_s = clock.sleep_share(backward=True)
        time.sleep(clock.sleep_share(backward=False))
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None


class BenchBlock(nn.Module):
    """One FSDP unit of the sleep/batch model: the drawn sleep, then a residual GELU MLP, timed."""

    def __init__(self, dim: int, hidden: int, clock: ComputeClock) -> None:
        super().__init__()
        self.clock = clock
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        x = EnterBlock.apply(x, self.clock)
        x = SleepShare.apply(x, self.clock)
        x = x + self.down(torch.nn.functional.gelu(self.up(x)))
        return LeaveBlock.apply(x, self.clock)


class SyncBenchMLP(nn.Module):
    """`layers` BenchBlocks in sequence (the sleep and batch cost models)."""

    def __init__(self, opts: SyncBenchOptions, clock: ComputeClock) -> None:
        super().__init__()
        self.layers = nn.ModuleList(BenchBlock(opts.dim, opts.hidden, clock) for _ in range(opts.layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def build_packed_model(opts: SyncBenchOptions, clock: ComputeClock, seed: int) -> Transformer:
    """moetrain's Transformer (dense blocks: the MoE router would add its own cost noise), instrumented.

    The clock enters at the input of each block's attention norm (after FSDP's all-gather)
    and leaves at the output of its feed-forward (before FSDP's post-forward); in
    backward the same two points bracket the block's math, with FSDP's pre-backward
    all-gather before and its reduce-scatter after.
    """
    cfg = ModelConfig(vocab_size=PACKED_VOCAB, dim=opts.dim, n_layers=opts.layers, n_heads=opts.heads,
                      ffn_hidden=opts.hidden, n_dense_layers=opts.layers, max_seq_len=opts.packed_tokens)
    model = Transformer(cfg)
    model.init_weights(seed=seed)
    for layer in model.layers:
        layer.attention_norm.register_forward_pre_hook(lambda module, args: (EnterBlock.apply(args[0], clock),))
        layer.feed_forward.register_forward_hook(lambda module, args, out: LeaveBlock.apply(out, clock))
    return model


def build_model(opts: SyncBenchOptions, clock: ComputeClock, seed: int) -> nn.Module:
    """The cost model's network with `.layers` (one FSDP unit each), instrumented by `clock`."""
    if opts.cost_model == "packed":
        return build_packed_model(opts, clock, seed)
    torch.manual_seed(seed)
    return SyncBenchMLP(opts, clock)


# ----------------------------------------------------------------------------- one microbatch from its cost


def packed_shape(opts: SyncBenchOptions, cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(documents, tokens per document) of packed microbatches whose documents are `cost` tokens long.

    Every document of one microbatch has the drawn length, so the microbatch is a
    [documents, length] batch with causal attention inside each row: exactly a packed
    sequence with document masking, at about `packed_tokens` tokens whatever the mix,
    but with attention cost growing with the document length.
    """
    length = np.minimum(as_batch_sizes(np.asarray(cost)), opts.packed_tokens)
    return np.maximum(opts.packed_tokens // length, 1), length


def work_units(opts: SyncBenchOptions, costs: np.ndarray) -> np.ndarray:
    """What a microbatch's compute scales with: seconds (sleep), samples (batch), document length (packed)."""
    if opts.cost_model == "batch":
        return as_batch_sizes(costs).astype(float)
    if opts.cost_model == "packed":
        return packed_shape(opts, costs)[1].astype(float)
    return np.asarray(costs, dtype=float)


def items_per_microbatch(opts: SyncBenchOptions, costs: np.ndarray) -> np.ndarray:
    """Throughput units per rank and microbatch: samples (sleep, batch) or tokens (packed)."""
    if opts.cost_model == "batch":
        return as_batch_sizes(costs)
    if opts.cost_model == "packed":
        documents, length = packed_shape(opts, costs)
        return documents * length
    return np.full(np.shape(costs), opts.microbatch_size)


def microbatch_inputs(opts: SyncBenchOptions, cost: float, device: torch.device,
                      generator: torch.Generator) -> torch.Tensor:
    """The model input of one microbatch of drawn `cost` (token ids for packed, activations otherwise)."""
    if opts.cost_model == "packed":
        documents, length = packed_shape(opts, np.array(cost))
        return torch.randint(0, PACKED_VOCAB, (int(documents), int(length)), generator=generator).to(device)
    samples = int(as_batch_sizes(np.array(cost))) if opts.cost_model == "batch" else opts.microbatch_size
    # requires_grad: the first block's backward (and its share of the sleep) must run too.
    return torch.randn(samples, opts.seq_len, opts.dim, generator=generator).to(device).requires_grad_(True)
