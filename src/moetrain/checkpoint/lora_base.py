"""The frozen base a LoRA run's checkpoints continue: its identity, stored with the trainer state, checked on resume.

A LoRA checkpoint holds the adapters and their optimizer state only (`storage.tensor_state` leaves
frozen parameters out); the base weights come again from `model.init_from` at every start. Resuming on
another base would silently pair the adapters with weights they were not trained on, so each checkpoint
records the base's identity, its directory and a SHA-256 over the files that hold its weights and
architecture (config.json and the safetensors files, names and contents; read once per process), or the
seed and scheme of a drawn base, and a resumed job's base must have the same hash. This module reads files
and compares; it must not load tensors or decide when to save.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

from moetrain.config.job import JobConfig
from moetrain.errors import ConfigError

STATE_KEY = "lora_base"  # the trainer state's entry
_CHUNK = 1 << 24


@functools.lru_cache(maxsize=4)
def directory_hash(directory: str) -> str:
    """SHA-256 over config.json and every *.safetensors file of `directory` (names and bytes, in name order)."""
    root = Path(directory)
    digest = hashlib.sha256()
    for path in sorted([root / "config.json", *root.glob("*.safetensors")]):
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def base_identity(cfg: JobConfig) -> dict[str, Any]:
    """{"path", "sha256"} of the job's base directory, or {"path": None, "sha256": "init:..."} for a drawn base."""
    init_from = cfg.model.init_from
    if init_from is None:
        return {"path": None, "sha256": f"init:seed={cfg.train.seed}:scheme={cfg.model.init_scheme}"}
    directory = Path(init_from.removeprefix("hf:")).resolve()
    return {"path": str(directory), "sha256": directory_hash(str(directory))}


def check_base_identity(saved: Any, cfg: JobConfig, checkpoint: Path) -> None:
    """One ConfigError line unless `saved` (a checkpoint's entry) is the identity of this job's base."""
    if not isinstance(saved, dict) or not isinstance(saved.get("sha256"), str):
        raise ConfigError(f"checkpoint {checkpoint} records no LoRA base (it was not written by a LoRA run with "
                          "lora.rank > 0); resume it with lora.rank = 0 or choose another --logging.run_dir")
    ours = base_identity(cfg)
    if saved["sha256"] != ours["sha256"]:
        raise ConfigError(f"model.init_from = {cfg.model.init_from!r} is another base than the one checkpoint "
                          f"{checkpoint} trained its adapters on ({saved.get('path') or saved['sha256']}, content "
                          "hash differs); resume on that base or choose another --logging.run_dir")
