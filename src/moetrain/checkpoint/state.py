"""A checkpoint's small state: the trainer's JSON (`trainer.json` + its tensors), RNG states and the stored config.

`trainer.json` holds the step, counters and every rank's `per_rank_state()` (loader position,
RNG states), gathered so one copy serves all ranks. Any tensor inside is stored in
`trainer_tensors.safetensors` and referenced from the JSON; nothing is pickled. `config.json` is
the job's config at the save, compared with a resuming job's before anything loads.

The small state is checked before it is used: `trainer.json` must hold the step, world size and
per-rank entries of the types the trainer writes (an RNG state of the right size), `config.json` a
job config; anything else, however consistent with the manifest, is one ConfigError line.

This module turns small state into files and back; it must not touch the model's or optimizer's tensors.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.torch
import torch
from safetensors import SafetensorError

from moetrain.checkpoint.layout import CONFIG_FILE, TRAINER_FILE, TRAINER_TENSORS_FILE, CheckpointRef
from moetrain.checkpoint.lora_base import STATE_KEY, check_base_identity
from moetrain.checkpoint.manifest import require_verified
from moetrain.config.job import JobConfig, from_dict
from moetrain.errors import ConfigError

TENSOR_REF = "__tensor__"  # {"__tensor__": key}: a tensor stored in trainer_tensors.safetensors

# Fields a resumed job may change without changing what the checkpoint means: how the initial
# weights were made (the checkpoint replaces them), the expert kernel (same parameters, same
# function) and whether unreadable files are skipped (a corpus that loads is the same corpus).
RESUME_MAY_DIFFER = frozenset({"model.init_from", "model.init_scheme", "model.init_scale_embedding",
                               "model.moe.impl", "data.skip_bad_files", "lora.init_from", "lora.dropout"})


def to_json(obj: Any, tensors: dict[str, torch.Tensor], key: str) -> Any:
    """`obj` as JSON values, each tensor copied into `tensors` under its path from `key` and referenced by it."""
    if isinstance(obj, torch.Tensor):
        # A copy: safetensors refuses tensors that share memory, and views of larger storages.
        tensors[key] = obj.detach().cpu().clone().contiguous()
        return {TENSOR_REF: key}
    if isinstance(obj, dict):
        out = {}
        for name, value in obj.items():
            if not isinstance(name, str) or name == TENSOR_REF:
                raise TypeError(f"checkpoint state {key}: key {name!r} cannot be stored (string keys only, "
                                f"not {TENSOR_REF!r})")
            out[name] = to_json(value, tensors, f"{key}.{name}")
        return out
    if isinstance(obj, (list, tuple)):  # tuples come back as lists
        return [to_json(value, tensors, f"{key}.{i}") for i, value in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, np.generic):  # a numpy scalar (e.g. from an index computation) as its Python value
        return obj.item()
    raise TypeError(f"checkpoint state {key}: a {type(obj).__name__} cannot be stored as JSON or a tensor")


def _from_json(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {TENSOR_REF}:
            return tensors[obj[TENSOR_REF]]
        return {name: _from_json(value, tensors) for name, value in obj.items()}
    if isinstance(obj, list):
        return [_from_json(value, tensors) for value in obj]
    return obj


def read_json(path: Path) -> Any:
    """The JSON value of a verified checkpoint file; ConfigError (one line) when it is not JSON moetrain wrote."""
    try:
        return json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path} is not valid JSON: {err}") from None
    except RecursionError:
        raise ConfigError(f"{path} nests deeper than JSON is read here (not a file moetrain wrote)") from None


def is_int(value: Any) -> bool:
    """True for an integer that is not a bool (JSON's true/false parse as bools)."""
    return isinstance(value, int) and not isinstance(value, bool)


def capture_rng_state() -> dict[str, Any]:
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": [version, list(internal), gauss_next]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _rng_problem(rng: Any) -> str | None:
    """Why `rng` is not a state `restore_rng_state` can restore (tried on throwaway generators), or None."""
    if not isinstance(rng, dict) or not isinstance(rng.get("torch"), torch.Tensor) or "python" not in rng:
        return "is not an RNG state (torch and python generators)"
    try:
        torch.Generator().set_state(rng["torch"])
        version, internal, gauss_next = rng["python"]
        random.Random().setstate((version, tuple(internal), gauss_next))
    except (RuntimeError, TypeError, ValueError, OverflowError) as err:
        return f"is not a restorable RNG state ({str(err).splitlines()[0] if str(err) else type(err).__name__})"
    cuda = rng.get("cuda")
    if cuda is not None and not (isinstance(cuda, torch.Tensor) and cuda.dtype == torch.uint8 and cuda.dim() == 1):
        return "has a CUDA RNG state that is not a 1-d uint8 tensor"
    return None


def _check_trainer_state(state: dict[str, Any], path: Path, step: int,
                         like: tuple[dict[str, Any], dict[str, Any]] | None = None) -> None:
    """Refuse (one line naming the entry) small state of other types than `save_checkpoint` writes.

    The manifest only proves the files are as written by whoever wrote them last: a hand-edited
    trainer.json with a consistent manifest must still end in one line, not deep in the trainer.
    Checked always: step, world size, the per-rank list, a data-loader position and RNG state
    where present. `like` = (trainer state, per-rank state) of the loading trainer: each of their
    keys must be present, with an integer where theirs is one and an object where theirs is one.
    """
    where = path / TRAINER_FILE

    def refuse(what: str) -> ConfigError:
        return ConfigError(f"{where}: {what}; it was not written by moetrain (restore the checkpoint or "
                           "resume from another one)")

    if not is_int(state.get("step")) or state["step"] != step:
        raise refuse(f"step = {state.get('step')!r:.60} is not the step {step} of its directory")
    world, ranks = state.get("world_size"), state.get("ranks")
    if not is_int(world) or world < 1 or not isinstance(ranks, list) or len(ranks) != world:
        raise refuse(f"world_size = {world!r:.60} does not match its list of per-rank states")
    top, per_rank = like if like is not None else ({}, {})
    for key, mine in top.items():
        if key not in state or (is_int(mine) and not is_int(state[key])):
            raise refuse(f"{key} = {state.get(key)!r:.60} is not {'an integer' if is_int(mine) else 'present'}")
    for rank, entry in enumerate(ranks):
        if not isinstance(entry, dict):
            raise refuse(f"ranks[{rank}] is not a per-rank state (a JSON object)")
        for key, mine in per_rank.items():
            if key not in entry or (isinstance(mine, dict) and not isinstance(entry[key], dict)):
                raise refuse(f"ranks[{rank}].{key} is missing or not a JSON object")
        loader = entry.get("loader")
        if loader is not None:
            cursor = loader.get("cursor") if isinstance(loader, dict) else None
            if not isinstance(loader, dict) or ("cursor" in loader and not (is_int(cursor) and cursor >= 0)):
                raise refuse(f"ranks[{rank}].loader.cursor = {cursor!r:.60} is not a position (an integer >= 0)")
        if "rng" in entry:
            problem = _rng_problem(entry["rng"])
            if problem is not None:
                raise refuse(f"ranks[{rank}].rng {problem}")


def write_trainer_state(root: Path, state: Any, tensors: dict[str, torch.Tensor]) -> None:
    """Write `to_json`'s output `state` and the `tensors` it refers to into checkpoint directory `root`."""
    (root / TRAINER_FILE).write_text(json.dumps(state))
    if tensors:
        safetensors.torch.save_file(tensors, root / TRAINER_TENSORS_FILE)


def read_trainer_state(path: Path, step: int, like: tuple[dict[str, Any], dict[str, Any]] | None = None
                       ) -> dict[str, Any]:
    """The trainer state of the (verified) checkpoint `path` of `step`, checked by `_check_trainer_state`."""
    tensors_file = path / TRAINER_TENSORS_FILE
    try:
        tensors = safetensors.torch.load_file(tensors_file) if tensors_file.exists() else {}
    except SafetensorError as err:
        raise ConfigError(f"{tensors_file} is not a readable safetensors file: {err}") from None
    state = read_json(path / TRAINER_FILE)
    if not isinstance(state, dict):
        raise ConfigError(f"{path / TRAINER_FILE} does not hold a JSON object")
    try:
        state = _from_json(state, tensors)
    except (KeyError, TypeError) as err:
        raise ConfigError(f"{path / TRAINER_FILE} refers to tensor {err} that {tensors_file} does not hold") from None
    except RecursionError:
        raise ConfigError(f"{path / TRAINER_FILE} nests deeper than a trainer state does") from None
    _check_trainer_state(state, path, step, like)
    return state


def stored_config(ref: CheckpointRef) -> JobConfig | None:
    """The job config saved with the checkpoint (None for checkpoints saved without one)."""
    ref = require_verified(ref)
    path = ref.path / CONFIG_FILE
    if not path.exists():
        return None
    stored = read_json(path)
    if not isinstance(stored, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    try:
        return from_dict(stored)
    except ConfigError as err:
        raise ConfigError(f"{path}: {err}") from None


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for name, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = value
    return flat


def check_resume_config(ref: CheckpointRef, job: JobConfig) -> None:
    """Refuse (one line naming the field) a job whose model, data or seed differ from the checkpoint's.

    The same check whatever the world sizes of the writer and the reader: the checkpoint's stored
    config is compared field by field, before the model is built or any tensor is read.
    """
    saved = stored_config(ref)
    if saved is None:
        raise ConfigError(f"checkpoint {ref.path} has no {CONFIG_FILE}: cannot check that this job continues it")
    old, new = _flatten(saved.to_dict()), _flatten(job.to_dict())
    checked = [k for k in sorted(new) if k.startswith(("model.", "lora."))] + \
              [k for k in sorted(new) if k.startswith("data.") or k == "train.seed"]
    for key in checked:
        if key in RESUME_MAY_DIFFER or old.get(key) == new[key]:
            continue
        why = ("the model's architecture cannot change on resume" if key.startswith(("model.", "lora.")) else
               "another seed or other data would not continue the same run")
        raise ConfigError(f"{key} = {new[key]!r} differs from {old.get(key)!r} in checkpoint {ref.path} ({why}); "
                          "use the checkpoint's value or another --logging.run_dir")
    if job.lora.enabled:  # the adapters continue only on the base they were trained on (checkpoint/lora_base.py)
        check_base_identity(read_trainer_state(ref.path, ref.step).get(STATE_KEY), job, ref.path)
