"""Resumable, data-parallel loader over packed sequences.

Every epoch visits the sequences in a fresh order, a permutation drawn from a
generator seeded by (seed, epoch) — the same on every rank and in every run. Rank r
of a data-parallel world of W ranks reads the strided slice perm[r::W], cut to the
same length on every rank, so ranks never share a sequence within an epoch. Each
call to `next_batch(n)` takes the next n sequences of this rank's slice; n may
change from call to call (variable microbatch sizes), and a batch that runs past
the end of the epoch continues in the next one.

The loader's whole position is (epoch, cursor): `state_dict()` returns it and
`load_state_dict()` restores it, so a resumed run reads exactly the batches an
uninterrupted run would have read. This module does no I/O and no collectives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moetrain.data.packing import Batch, PackedSequences
from moetrain.errors import ConfigError


@dataclass(frozen=True)
class LoaderPosition:
    epoch: int
    cursor: int


class DataLoader:
    def __init__(self, sequences: PackedSequences, seed: int, dp_rank: int = 0, dp_world: int = 1):
        if not 0 <= dp_rank < dp_world:
            raise ValueError(f"dp_rank {dp_rank} outside a data-parallel world of {dp_world}")
        self.sequences = sequences
        self.seed, self.dp_rank, self.dp_world = seed, dp_rank, dp_world
        self.per_rank = len(sequences) // dp_world
        if self.per_rank == 0:
            raise ConfigError(f"the training data packs into {len(sequences)} sequences of "
                              f"data.seq_len = {sequences.seq_len}, fewer than the {dp_world} data-parallel "
                              "ranks; use more data or a shorter data.seq_len")
        self.epoch, self.cursor = 0, 0
        self._order_epoch = -1
        self._order = torch.empty(0, dtype=torch.long)

    def _rank_order(self, epoch: int) -> torch.Tensor:
        if epoch != self._order_epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            permutation = torch.randperm(len(self.sequences), generator=generator)
            self._order = permutation[self.dp_rank::self.dp_world][: self.per_rank]
            self._order_epoch = epoch
        return self._order

    def next_indices(self, batch_size: int) -> list[int]:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        indices: list[int] = []
        while len(indices) < batch_size:
            order = self._rank_order(self.epoch)
            take = min(batch_size - len(indices), self.per_rank - self.cursor)
            indices += order[self.cursor: self.cursor + take].tolist()
            self.cursor += take
            if self.cursor == self.per_rank:
                self.epoch, self.cursor = self.epoch + 1, 0
        return indices

    def next_batch(self, batch_size: int) -> Batch:
        return self.sequences.batch(self.next_indices(batch_size))

    @property
    def position(self) -> LoaderPosition:
        return LoaderPosition(self.epoch, self.cursor)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "dp_rank": self.dp_rank,
                "dp_world": self.dp_world, "n_sequences": len(self.sequences), "seq_len": self.sequences.seq_len}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by a loader over the same data and data-parallel world."""
        if (state["n_sequences"], state["seq_len"]) != (len(self.sequences), self.sequences.seq_len):
            raise ConfigError(f"the checkpoint's data has {state['n_sequences']} sequences of length "
                              f"{state['seq_len']} but this run's has {len(self.sequences)} of length "
                              f"{self.sequences.seq_len}; resume with the same data settings")
        if state["seed"] != self.seed:
            raise ConfigError(f"train.seed = {self.seed} differs from the checkpoint's seed {state['seed']}; "
                              "resume with the same seed")
        if (state["dp_rank"], state["dp_world"]) != (self.dp_rank, self.dp_world):
            raise ValueError("loader state belongs to another rank or world; use resume_from_other_world")
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])

    def resume_from_other_world(self, states: list[dict[str, Any]]) -> None:
        """Continue from the states of a different data-parallel world (approximate).

        The strided slices differ between world sizes, so the exact batches cannot be
        replayed; this keeps the epoch and the fraction of it already consumed (the
        sequences consumed by the old world, spread over the new one).
        """
        epoch = min(int(s["epoch"]) for s in states)
        consumed = sum(int(s["cursor"]) for s in states if int(s["epoch"]) == epoch)
        self.epoch = epoch
        self.cursor = min(consumed // self.dp_world, self.per_rank - 1)
