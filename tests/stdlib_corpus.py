"""Training text and command lines for the tests that train: small standard-library modules copied into a
directory (real Python text, nothing downloaded), and a job's fields as `moetrain train` options."""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path

from moetrain.data.corpus import stdlib_root

TINY_MOE_TOML = Path(__file__).resolve().parents[1] / "configs" / "tiny_moe.toml"


def copy_stdlib_modules(directory: Path, names: Iterable[str]) -> Path:
    """`directory` (made if missing) holding a copy of each named standard-library module."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        shutil.copyfile(stdlib_root() / name, directory / name)
    return directory


def tiny_moe_args(fields: dict[str, object]) -> list[str]:
    """`--config configs/tiny_moe.toml` followed by `--field value` for each of `fields`."""
    args = ["--config", str(TINY_MOE_TOML)]
    for key, value in fields.items():
        args += [f"--{key}", str(value)]
    return args
