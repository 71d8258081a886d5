"""Command-line parsing for every subcommand: tyro over dataclasses, errors as one line.

Each subcommand describes its options as a dataclass and calls `parse_typed_args`.
Job configs (`train` and friends) take explicit values for booleans
(`--checkpoint.resume True`), so a TOML field and its override read alike; small
command option sets (`init-report --json`, `bench moe --sweep`) keep booleans as
flags. `--help` prints tyro's help; a bad value raises `ConfigError` whose message is
the one line of tyro's error box; values no command can use (beyond int64, non-finite, not UTF-8)
are refused for every option. Input files an option names are read, and output places checked, with
one-line refusals (read_input_text, read_input_json, check_output_path). This module knows nothing
about what is parsed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import io
import json
import math
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import tyro

from moetrain.errors import ConfigError

T = TypeVar("T")


def parse_typed_args(cls: type[T], args: list[str], prog: str, default: T | None = None,
                     bool_flags: bool = False, description: str | None = None) -> T:
    """Parse `--field value` arguments into dataclass `cls` (fields of nested dataclasses as `--a.b`).

    `default` supplies the values of fields not given; `bool_flags` turns booleans into
    `--name` / `--no-name` flags instead of `--name True|False`; `description` replaces `cls`'s
    docstring at the top of `--help` (for text built at run time).
    """
    kwargs = _tyro_kwargs(prog, default, bool_flags)
    if description is not None:
        kwargs["description"] = description
    if any(a in ("-h", "--help") for a in args):
        return tyro.cli(cls, args=args, **kwargs)
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured), contextlib.redirect_stdout(captured):
            parsed = tyro.cli(cls, args=args, **kwargs)
    except SystemExit:
        message = first_message_line(captured.getvalue())
        if message.startswith("Unrecognized options"):
            message = _did_you_mean(cls, args, bool_flags) or message
        raise ConfigError(f"{message} (run `{prog} --help` for options)") from None
    check_option_values(parsed)
    return parsed


def _did_you_mean(cls: type, args: list[str], bool_flags: bool) -> str:
    """'unknown option --x (did you mean --y?)' for each option of `args` that `cls` lacks; '' if none."""
    known = option_help(cls, bool_flags)
    spelled = {_underscored(name) for name in known}  # tyro takes --run-dir for --run_dir
    unknown = [a.split("=")[0] for a in args if a.startswith("--") and _underscored(a.split("=")[0]) not in spelled]
    if not unknown:
        return ""
    described = []
    for arg in unknown:
        close = difflib.get_close_matches(_underscored(arg), sorted(spelled), n=1, cutoff=0.8)
        if close and "-" in arg[2:]:  # suggested in the user's own spelling
            close = ["--" + close[0][2:].replace("_", "-")]
        described.append(f"{arg} (did you mean {close[0]}?)" if close else arg)
    return f"unknown option{'s' if len(unknown) > 1 else ''} {', '.join(described)}"


def _underscored(option: str) -> str:
    return "--" + option[2:].replace("-", "_")


def _tyro_kwargs(prog: str, default: Any, bool_flags: bool) -> dict[str, Any]:
    markers = () if bool_flags else (tyro.conf.FlagConversionOff,)
    kwargs: dict[str, Any] = dict(prog=prog, use_underscores=True, config=markers)
    if default is not None:
        kwargs["default"] = default
    return kwargs


def print_help(cls: type, prog: str, bool_flags: bool = False) -> NoReturn:
    """Print `cls`'s --help as `prog` and exit 0 (tyro's help, as parse_typed_args would print it)."""
    tyro.cli(cls, args=["--help"], **_tyro_kwargs(prog, None, bool_flags))
    raise SystemExit(0)  # pragma: no cover - tyro exits on --help


def option_help(cls: type, bool_flags: bool = False) -> dict[str, str]:
    """Every option tyro makes of `cls` (each name and alias) -> its help text as `--help` shows it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # get_parser: tyro's parser, the one --help prints
        parser = tyro.extras.get_parser(cls, **_tyro_kwargs("moetrain", None, bool_flags))
    return {name: action.help or "" for action in parser._actions for name in action.option_strings}


INT64_MAX = (1 << 63) - 1


def check_option_values(obj: Any, prefix: str = "--") -> None:
    """Refuse (one line) what tyro parses but no command can use, in every option, so a new option is covered:
    an integer beyond int64 (torch, numpy and the C libraries below them overflow on it, far from the option),
    a float that is nan or infinite ("1e999" parses as inf), text that is not UTF-8 (bytes the shell could
    not decode: the runs write their options to UTF-8 JSON and TOML). Lists and tuples are checked item by item."""
    if not dataclasses.is_dataclass(obj):
        return
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        name = f"{prefix}{field.name.replace('_', '-') if prefix == '--' else field.name}"
        for item in value if isinstance(value, (list, tuple)) else (value,):
            _check_option_value(name, item)
        check_option_values(value, f"{name.lstrip('-')}.")  # a nested field as a TOML key: section.field


def _check_option_value(name: str, value: Any) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and not -INT64_MAX <= value <= INT64_MAX:
        raise ConfigError(f"{name} = {value} is invalid: beyond the 64-bit integer range")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{name} = {value} is invalid: must be a finite number")
    if isinstance(value, str) and not is_utf8(value):
        raise ConfigError(f"{name} = {value!r} is invalid: not UTF-8 text (bytes the shell could not decode)")


def is_utf8(text: str) -> bool:
    """Whether `text` came from UTF-8 bytes (Python hands undecodable argv bytes over as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def read_input_text(path: str | Path, option: str, max_bytes: int = 1 << 30) -> str:
    """The UTF-8 text of the file an option names, or one ConfigError line naming the option and the file:
    missing, a directory, not a regular file (a FIFO would block, /dev/zero never ends), larger than
    `max_bytes`, unreadable or not UTF-8."""
    path = Path(path)
    where = f"{option} {str(path)!r}"
    if not path.exists():
        raise ConfigError(f"{where} does not exist")
    if path.is_dir():
        raise ConfigError(f"{where} is a directory; pass a file")
    if not path.is_file():
        raise ConfigError(f"{where} is not a regular file (a FIFO or device); pass a file")
    if path.stat().st_size > max_bytes:
        raise ConfigError(f"{where} is larger than {max_bytes} bytes")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{where} is not UTF-8 text (bad byte at offset {err.start})") from None
    except OSError as err:
        raise ConfigError(f"{where} is unreadable ({err.strerror or type(err).__name__})") from None


def read_input_json(path: str | Path, option: str) -> Any:
    """The JSON value of the file an option names (read_input_text's refusals, and: not JSON, truncated,
    nested too deeply to parse, NaN or Infinity), else one ConfigError line naming the option and the file."""
    text = read_input_text(path, option)
    where = f"{option} {str(path)!r}"

    def no_constant(name: str) -> Any:
        raise ConfigError(f"{where} is not valid JSON: it holds {name} (a number must be finite)")

    try:
        return json.loads(text, parse_constant=no_constant)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{where} is not valid JSON: {err}") from None
    except RecursionError:
        raise ConfigError(f"{where} is not valid JSON: nested too deeply to read") from None


def check_output_path(path: str | Path, option: str) -> None:
    """Refuse (one line, before any work) an output place that cannot be written: below a regular file, or in
    a directory where no file can be made (read-only, /proc). Probes with a file it removes at once."""
    path = Path(path)
    where = f"{option} {str(path)!r}"
    parent = path if path.is_dir() else path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{where} cannot be written: {str(parent)!r} is a file, not a directory")
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=".moetrain-probe-")
    except OSError as err:
        raise ConfigError(f"{where} cannot be written: {err.strerror or type(err).__name__} in {str(parent)!r}") \
            from None
    os.close(fd)
    os.unlink(probe)


def first_message_line(text: str) -> str:
    """The message paragraph of tyro's error output joined onto one line.

    tyro prints a title, a rule, then the message (boxed on a terminal, plain when captured).
    """
    paragraphs: list[list[str]] = [[]]
    for raw in text.splitlines():
        line = raw.strip().strip("│|╭╮").strip()
        if raw.lstrip().startswith("╭") or not line or set(line) <= set("-─╰╯+"):
            if raw.lstrip().startswith("╭"):
                paragraphs[-1].append(line.strip("─ "))
            if paragraphs[-1]:
                paragraphs.append([])
            continue
        paragraphs[-1].append(line)
    paragraphs = [p for p in paragraphs if p]
    chosen = paragraphs[1] if len(paragraphs) > 1 else (paragraphs or [["bad command-line option"]])[0]
    return " ".join(chosen)


def take_option(args: list[str], name: str) -> tuple[str | None, list[str]]:
    """Remove `--name VALUE` (or `--name=VALUE`) from `args`; return (VALUE or None, the rest).

    Used for the one option that must be read before the others can be typed: a job's
    `--config FILE`, whose contents are the defaults the other overrides apply to.
    """
    flag = f"--{name}"
    value: str | None = None
    rest: list[str] = []
    index = 0
    while index < len(args):
        arg = args[index]
        if arg == flag:
            if index + 1 >= len(args) or args[index + 1].startswith("--"):
                raise ConfigError(f"{flag} needs a value")
            value = args[index + 1]
            index += 2
            continue
        if arg.startswith(flag + "="):
            value = arg[len(flag) + 1:]
        else:
            rest.append(arg)
        index += 1
    return value, rest
