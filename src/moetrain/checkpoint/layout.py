"""Where checkpoints live: the names inside a run's `checkpoints/` directory, which of them are complete, pruning.

A checkpoint is the directory `checkpoints/step_00000100/`; a write in progress is
`checkpoints/.tmp-step_00000100/`, renamed to its final name only when complete, so a `step_*`
directory is always whole and a `.tmp-*` one is never read (`remove_partial` deletes it).

Pruning (`prune`, after each save): the checkpoint just written and the one the run resumed from
are never deleted; checkpoints newer than the one just written are deleted first (a resume only
passes over damaged ones, so they are known-damaged or belong to a history the run has left);
of the older ones the newest `keep_last - 1` stay.

This module names and deletes directories; it must not read or write a checkpoint's files.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from moetrain.parallel.collectives import rank_and_world

# The files of one checkpoint directory.
TENSORS_DIR = "tensors"
TRAINER_FILE = "trainer.json"
TRAINER_TENSORS_FILE = "trainer_tensors.safetensors"
CONFIG_FILE = "config.json"
META_FILE = "meta.json"
MANIFEST_FILE = "manifest.json"

_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass(frozen=True)
class CheckpointRef:
    step: int
    path: Path
    verified: bool = False  # its files matched the manifest (set by verify/newest_intact)


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def list_complete(checkpoint_dir: str | Path) -> list[CheckpointRef]:
    """Checkpoints under their final name (whole when written; `verify` says whether still intact), oldest first."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    refs = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir():
            refs.append(CheckpointRef(int(match.group(1)), entry))
    return sorted(refs, key=lambda r: r.step)


def latest_complete(checkpoint_dir: str | Path) -> CheckpointRef | None:
    refs = list_complete(checkpoint_dir)
    return refs[-1] if refs else None


def remove_partial(checkpoint_dir: str | Path) -> list[Path]:
    """Delete temporary directories left by interrupted writes (rank 0 only)."""
    root = Path(checkpoint_dir)
    removed = []
    if rank_and_world()[0] == 0 and root.is_dir():
        for entry in root.iterdir():
            if entry.name.startswith(".tmp-"):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    return removed


def prune(checkpoint_dir: str | Path, keep_last: int, written: int, protect: tuple[int, ...] = (),
          damaged: tuple[int, ...] = ()) -> list[int]:
    """Delete checkpoints beyond `keep_last` after step `written` was saved; return the deleted steps.

    Never deleted: `written` and `protect` (the checkpoint the run resumed from). Deleted first:
    the `damaged` ones and every checkpoint newer than `written`: a run only writes a step below an
    existing one after its resume skipped that one as damaged (it resumes from the newest intact
    one), so those are known-damaged or of a history the run has left; counting them, as a prune
    by step number would, can leave only damaged checkpoints. Of the other, older ones the newest
    `keep_last - 1` stay (the protected one counts among them when it is one of them).
    """
    refs = list_complete(checkpoint_dir)
    kept = {written, *protect}
    bad = [r for r in refs if (r.step > written or r.step in damaged) and r.step not in kept]
    older = [r for r in refs if r.step < written and r not in bad]
    keep_older = {r.step for r in older[max(0, len(older) - (keep_last - 1)):]} if keep_last > 1 else set()
    doomed = bad + [r for r in older if r.step not in keep_older and r.step not in kept]
    for ref in doomed:
        shutil.rmtree(ref.path, ignore_errors=True)
    return [r.step for r in doomed]
