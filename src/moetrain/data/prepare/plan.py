"""The plan of a prepare: the train / held-out split, the shards it is cut into, their plan keys, and which
shards are still to write.

Documents are split into train and held-out by the hash of their names (moetrain.data.corpus.is_heldout),
so a document's side depends only on its own name and the split equals the one the trainer makes from
text. Prepare makes the split, not the trainer, because then each split's shards are one contiguous
stream on disk (a window is one or two slices of a memory map, no per-document gather) and the held-out
byte statistics are measured once, where the text is at hand.

Each split is cut into shards of about --shard-mb of text, a plan that depends only on the inputs and
options (not on --workers), and every shard is a job for the worker pool. A rerun skips every shard
whose entry exists with the same plan key, so an interrupted prepare continues where it stopped; a
shard of another plan in the output directory is an error, never overwritten. This module decides
the work; it does not read text, tokenize or write shards.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from moetrain.data.corpus import is_heldout
from moetrain.data.prepare.inputs import DocRef
from moetrain.data.shards import SPLITS, read_shard_entry, shard_stem
from moetrain.errors import ConfigError


class PackedShard:
    """The records of one shard being gathered by a streaming prepare (references and the values that streamed
    in with them), and its plan key so far. Held in memory only; it reaches a worker as a job argument."""

    def __init__(self, seed: bytes):
        self.seed, self.digest = seed, hashlib.sha256(seed)
        self.refs: list[DocRef] = []
        self.values: list[Any] = []
        self.bytes = 0

    @property
    def count(self) -> int:
        return len(self.refs)

    def add(self, ref: DocRef, value: Any) -> None:
        self.digest.update(_plan_line(ref))
        self.refs.append(ref)
        self.values.append(value)
        self.bytes += ref.length

    def plan_key(self) -> str:
        return self.digest.hexdigest()

    def __getstate__(self) -> dict[str, Any]:  # to a worker: the records (a hash object does not pickle)
        return {k: v for k, v in self.__dict__.items() if k != "digest"}

    def records(self) -> tuple[list[DocRef], list[Any]]:
        """(references, values: UNREAD where the worker reads the record itself)."""
        return list(self.refs), list(self.values)

    def pop(self) -> tuple[DocRef, Any]:
        """Take the last record out (the plan key is recomputed from the rest)."""
        ref, value = self.refs.pop(), self.values.pop()
        self.bytes -= ref.length
        self.digest = hashlib.sha256(self.seed)
        for kept in self.refs:
            self.digest.update(_plan_line(kept))
        return ref, value


def streamed_shards(records: Iterator[tuple[DocRef, Any]], heldout_fraction: float, shard_bytes: int,
                    seed: bytes) -> Iterator[tuple[str, int, PackedShard]]:
    """(split, index, records) of each shard as soon as it is complete: `split_refs` then `cut_shards` done
    in one pass, holding one open shard per split (a shard closes when the next document of its split finds
    it full, or at the end, where the tiny-corpus rule can still move the last training document to the
    held-out split). `seed` starts each shard's plan key (`plan_seed`)."""
    open_shards = {split: PackedShard(seed) for split in SPLITS}
    count, seen = dict.fromkeys(SPLITS, 0), dict.fromkeys(SPLITS, 0)
    for ref, value in records:
        split = "heldout" if is_heldout(ref.name, heldout_fraction) else "train"
        if open_shards[split].count and open_shards[split].bytes >= shard_bytes:
            yield split, count[split], open_shards[split]
            count[split] += 1
            open_shards[split] = PackedShard(seed)
        open_shards[split].add(ref, value)
        seen[split] += 1
    if not seen["train"] and not seen["heldout"]:
        raise ConfigError("--input holds no documents")
    if heldout_fraction > 0 and not seen["heldout"]:  # as split_refs: hold out the last document
        open_shards["heldout"].add(*open_shards["train"].pop())
        seen["train"] -= 1
        seen["heldout"] = 1
    if not seen["train"]:
        raise ConfigError(f"--heldout-fraction {heldout_fraction} leaves no training documents out of "
                          f"{seen['heldout']}")
    for split in SPLITS:
        if open_shards[split].count:
            yield split, count[split], open_shards[split]


def split_refs(refs: list[DocRef], heldout_fraction: float) -> dict[str, list[DocRef]]:
    """Train / held-out by name hash, with the trainer's rule for tiny corpora (hold out the last document)."""
    heldout = [r for r in refs if is_heldout(r.name, heldout_fraction)]
    train = [r for r in refs if not is_heldout(r.name, heldout_fraction)]
    if heldout_fraction > 0 and not heldout:
        heldout, train = train[-1:], train[:-1]
    if not train:
        raise ConfigError(f"--heldout-fraction {heldout_fraction} leaves no training documents out of {len(refs)}")
    return {"train": train, "heldout": heldout}


def cut_shards(refs: list[DocRef], shard_bytes: int) -> list[list[DocRef]]:
    shards: list[list[DocRef]] = []
    size = 0
    for ref in refs:
        if not shards or size >= shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(ref)
        size += ref.length
    return shards


def plan_seed(identity: dict[str, Any], options: dict[str, Any]) -> bytes:
    return json.dumps([identity, options], sort_keys=True).encode()


def _plan_line(ref: DocRef) -> bytes:
    return f"{ref.name}\0{ref.kind}\0{ref.path}\0{ref.start}\0{ref.length}\n".encode()


def plan_key(refs: list[DocRef], identity: dict[str, Any], options: dict[str, Any]) -> str:
    """What decides a shard's contents: its documents (names, places, sizes), the tokenizer and the text options."""
    digest = hashlib.sha256(plan_seed(identity, options))
    for ref in refs:
        digest.update(_plan_line(ref))
    return digest.hexdigest()


class ShardJobs:
    """The shards of one plan against those already finished in --out: a job for each shard still to write,
    the entry of each finished one (a rerun), an error for a finished shard of another plan."""

    def __init__(self, out: Path, identity: dict[str, Any], options: dict[str, Any], tokenizer_spec: str,
                 limits: dict[str, Any] | None = None):
        self.out, self.identity, self.options, self.tokenizer_spec = out, identity, options, tokenizer_spec
        self.limits = limits or {}  # what bounds a worker (a chat template's time), not what it writes: no key
        self.entries: dict[tuple[str, int], dict[str, Any]] = {}
        self.planned: set[tuple[str, int]] = set()
        self.new_shards: list[tuple[str, int]] = []

    def job_of(self, split: str, index: int, shard_refs: list[DocRef] | PackedShard) -> tuple | None:
        """The job preparing this shard, or None when it is finished already (a rerun) with the same plan."""
        key = shard_refs.plan_key() if isinstance(shard_refs, PackedShard) else plan_key(shard_refs, self.identity,
                                                                                          self.options)
        entry_path = self.out / f"{shard_stem(split, index)}.json"
        entry = read_shard_entry(entry_path)
        self.planned.add((split, index))
        if entry is None:
            self.new_shards.append((split, index))
            return (str(self.out), split, index, shard_refs,
                    {**self.options, **self.limits, "tokenizer": self.tokenizer_spec, "plan": key})
        if entry.get("plan") != key:
            raise ConfigError(f"{entry_path} is a finished shard of other inputs or options; finished shards "
                              "are never rewritten: use another --out or remove that directory")
        self.entries[(split, index)] = entry
        return None

    def finished(self, entry: dict[str, Any]) -> None:
        """Record the entry a worker returned for a shard it wrote."""
        self.entries[(entry["split"], entry["index"])] = entry

    def check_no_stale(self) -> None:
        """Refuse a finished shard in --out that this plan does not have (one of other inputs or options)."""
        for split in SPLITS:
            for stale in sorted((self.out / split).glob("shard_*.json")) if (self.out / split).is_dir() else []:
                if (split, int(stale.stem.split("_")[1])) not in self.planned:
                    raise ConfigError(f"{stale} is a finished shard of other inputs or options; use another "
                                      "--out or remove that directory")
