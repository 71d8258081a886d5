"""Command-line parsing for every subcommand: tyro over dataclasses, errors as one line.

Each subcommand describes its options as a dataclass and calls `parse_typed_args`.
Job configs (`train` and friends) take explicit values for booleans
(`--checkpoint.resume True`), so a TOML field and its override read alike; small
command option sets (`init-report --json`, `bench moe --sweep`) keep booleans as
flags. `--help` prints tyro's help; a bad value raises `ConfigError` whose message is
the one line of tyro's error box. This module knows nothing about what is parsed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import io
import warnings
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
    check_int64(parsed)
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


def check_int64(obj: Any, prefix: str = "--") -> None:
    """Refuse (one line) an integer option beyond int64: torch, numpy and the C libraries below them
    overflow on it ("Python int too large to convert"), far from the option that caused it."""
    if not dataclasses.is_dataclass(obj):
        return
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        name = f"{prefix}{field.name.replace('_', '-') if prefix == '--' else field.name}"
        if isinstance(value, int) and not isinstance(value, bool) and not -INT64_MAX <= value <= INT64_MAX:
            raise ConfigError(f"{name} = {value} is invalid: beyond the 64-bit integer range")
        check_int64(value, f"{name}.")


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
