"""Resumable, data-parallel loader with a global order that does not depend on the number of ranks.

The training data is a list of n *units* (packed sequences, or token-budget bins; see
moetrain.data.batching). They are read in one global stream: global unit g is unit
perm_e[g mod n] of epoch e = g div n, where perm_e is a permutation drawn from a
generator seeded by (seed, e). A step reads the next G = units_per_microbatch ×
microbatches_per_rank × dp_world global units (the global batch); rank r of W takes the
contiguous slice of microbatches r·A .. r·A + A - 1 of it (A = microbatches_per_rank).
So global unit i of step s is a function of (seed, s, i) alone, and the global batch of
a step, and even the content of each of its microbatches, is the same for any split of
the same global batch into ranks × accumulation (4 × 1, 2 × 2, 1 × 4).

Why a permutation over fixed units rather than, say, a shuffle buffer over a stream of
documents: it is a pure function of the global index (any rank can compute any part of
any step without reading what came before), it needs one permutation of n integers per
epoch and nothing else, it works directly on memory-mapped data (a unit is a slice), and
the whole loader state is one integer, the global cursor, which means the same thing on
any number of ranks: a run resumed on another world size with the same global batch
continues with exactly the batches it would have seen. A step may run into the next
epoch; with a global batch larger than n, one step can hold a unit twice (from two epochs).

This module does no I/O and no collectives.
"""

from __future__ import annotations

from typing import Any

import torch

from moetrain.data.batching import Batching
from moetrain.data.packing import Batch
from moetrain.errors import ConfigError


def epoch_permutation(n_units: int, seed: int, epoch: int) -> torch.Tensor:
    """The order of the units in one epoch: the same on every rank, in every run."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(n_units, generator=generator)


class DataLoader:
    def __init__(self, batching: Batching, seed: int, dp_rank: int = 0, dp_world: int = 1,
                 microbatches_per_rank: int = 1):
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"dp_rank {dp_rank} outside a data-parallel world of {dp_world}")
        if microbatches_per_rank < 1:
            raise ValueError(f"microbatches_per_rank must be >= 1, got {microbatches_per_rank}")
        if batching.n_units < 1:
            raise ConfigError("the training data has no units to batch; use more data")
        self.batching = batching
        self.seed, self.dp_rank, self.dp_world = seed, dp_rank, dp_world
        self.microbatches_per_rank = microbatches_per_rank
        self.cursor = 0  # the global index of the next step's first unit
        self._order_epoch = -1
        self._order = torch.empty(0, dtype=torch.long)

    @property
    def units_per_step(self) -> int:
        """Global units per step: the global batch."""
        return self.batching.units_per_microbatch * self.microbatches_per_rank * self.dp_world

    def unit(self, index: int) -> int:
        """The unit at global index `index`."""
        epoch, offset = divmod(index, self.batching.n_units)
        if epoch != self._order_epoch:
            self._order = epoch_permutation(self.batching.n_units, self.seed, epoch)
            self._order_epoch = epoch
        return int(self._order[offset])

    def step_units(self, cursor: int, rank: int) -> list[list[int]]:
        """The units of rank `rank`'s microbatches in the step that starts at global index `cursor`."""
        per_microbatch = self.batching.units_per_microbatch
        first = cursor + rank * self.microbatches_per_rank * per_microbatch
        # A mixture (moetrain.data.batching.MixtureBatching) maps global indices to its sources' units itself.
        unit = (lambda g: g) if getattr(self.batching, "takes_global_indices", False) else self.unit
        return [[unit(first + m * per_microbatch + j) for j in range(per_microbatch)]
                for m in range(self.microbatches_per_rank)]

    def next_microbatches(self) -> list[Batch]:
        """This rank's microbatches of the next step, and advance to the step after it."""
        units = self.step_units(self.cursor, self.dp_rank)
        self.cursor += self.units_per_step
        return [self.batching.microbatch(u) for u in units]

    def state_dict(self) -> dict[str, Any]:
        """The loader's position: the same on every rank and valid for any world size."""
        return {"cursor": self.cursor, "seed": self.seed, **self.batching.signature()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a position saved by a loader over the same data, on any number of ranks."""
        if "cursor" not in state:
            raise ConfigError("the checkpoint's data-loader state predates the rank-independent data order "
                              "(it has no global cursor); start a new run")
        if state["seed"] != self.seed:
            raise ConfigError(f"train.seed = {self.seed} differs from the checkpoint's seed {state['seed']}; "
                              "resume with the same seed")
        ours = self.batching.signature()
        theirs = {key: state.get(key) for key in ours}
        if theirs != ours:
            raise ConfigError(f"the checkpoint's data was batched as {theirs} but this run's is {ours}; "
                              "resume with the same data and data.batching settings")
        self.cursor = int(state["cursor"])
