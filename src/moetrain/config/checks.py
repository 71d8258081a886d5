"""The one-line checks every config section builds its `validate()` from.

A failed check raises `ConfigError` with one line naming the field, the bad value and what
would be valid. This module knows no section and no field: the sections say what to check.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Iterable
from typing import Any, Literal

from moetrain.errors import ConfigError


def check(ok: bool, name: str, value: Any, valid: str) -> None:
    """Raise `ConfigError` "NAME = VALUE is invalid: VALID" unless `ok`."""
    if not ok:
        raise ConfigError(f"{name} = {value!r} is invalid: {valid}")


def check_positive(section: Any, prefix: str, names: Iterable[str]) -> None:
    """Each named integer field of `section` (spelled `prefix.name` in the message) is >= 1."""
    for name in names:
        value = getattr(section, name)
        check(value >= 1, f"{prefix}.{name}", value, "must be a positive integer")


def check_nonnegative(section: Any, prefix: str, names: Iterable[str]) -> None:
    """Each named numeric field of `section` (spelled `prefix.name` in the message) is >= 0."""
    for name in names:
        value = getattr(section, name)
        check(value >= 0, f"{prefix}.{name}", value, "must be >= 0")


def type_name(tp: Any) -> str:
    """A field type as an error message spells it: "one of 'a', 'b'" for a Literal, else its name."""
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(tp))
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def check_field_types(obj: Any, prefix: str = "") -> None:
    """Generic checks over every field of a config tree, so a new field is covered without being listed.

    A float must be finite (TOML and tyro both accept inf and nan), and an integer field must not hold
    a boolean (bool is an int subclass, so `steps = true` would otherwise train 1 step).
    """
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, name = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            check_field_types(value, name + ".")
            continue
        allowed = typing.get_args(hints[f.name]) or (hints[f.name],)
        if isinstance(value, bool) and bool not in allowed:
            raise ConfigError(f"{name} = {value!r} has the wrong type: expected {type_name(hints[f.name])}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{name} = {value!r} is invalid: must be a finite number")
        if isinstance(value, int) and not -(1 << 63) < value < 1 << 63:  # torch and C code overflow past int64
            raise ConfigError(f"{name} = {value!r} is invalid: beyond the 64-bit integer range")
