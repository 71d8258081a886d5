"""The bad-input sweep's machinery: every option of a command, read from its own parser, paired with bad values.

`command_options(main, words)` runs `main([*words, "--help"])` with tyro's entry point intercepted and
returns the options of the parser the command builds (argparse actions, as `--help` prints them), so an
option added to a command is swept without being listed anywhere. `bad_values(option)` gives the bad
values of the option's kind (non-finite, negative, beyond the type's range, wrong-typed, not UTF-8).
`run_case(main, argv)` runs one command line in this process (torch is imported once for all cases)
with file descriptor 2 captured and a time limit, and `snapshot(root)` lists a tree's files so a caller
can tell that a refused case wrote nothing. Bad *files* (FIFOs, directories, /dev/zero, binary,
truncated or deeply nested JSON, unwritable places) are made by `bad_files`.
This module imports nothing from moetrain: the command's entry is passed in, so it sits below every layer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import os
import re
import resource
import signal
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import tyro

Main = Callable[[list[str]], int]


class _ParserFound(BaseException):
    """Raised by the intercepted tyro entry: carries the dataclass and the keyword arguments of the parser."""


class Accepted(BaseException):
    """Raised by a hook placed where a command starts its work: the options were all accepted.

    A BaseException, so a command's own `except Exception` does not turn it into an error line."""


@dataclasses.dataclass(frozen=True)
class Option:
    """One option of a command's parser: its spellings, what kind of value it takes, and whether several."""

    names: tuple[str, ...]
    kind: str  # int, float, str, choice, bool, flag, positional
    many: bool  # nargs "*" or "+": a list of values

    @property
    def name(self) -> str:
        return self.names[0]

    def named_in(self, line: str) -> bool:
        """Whether `line` names this option in one of its spellings (dashes and underscores alike)."""
        text = line.replace("-", "_")
        return any(re.search(r"(?<![A-Za-z0-9.])" + re.escape(n.lstrip("-").replace("-", "_")) + r"(?![A-Za-z0-9])",
                             text) for n in self.names)


@contextlib.contextmanager
def _intercepted_tyro() -> Iterator[None]:
    real = tyro.cli

    def intercept(cls: Any, *args: Any, **kwargs: Any) -> Any:
        if "--help" in list(kwargs.get("args") or ()):
            raise _ParserFound(cls, {k: v for k, v in kwargs.items() if k != "args"})
        return real(cls, *args, **kwargs)

    tyro.cli = intercept
    try:
        yield
    finally:
        tyro.cli = real


def command_options(main: Main, words: list[str]) -> list[Option]:
    """The options of `main([*words, ...])`'s parser, as its `--help` would list them (help itself left out)."""
    with _intercepted_tyro():
        try:
            main([*words, "--help"])
        except _ParserFound as found:
            cls, kwargs = found.args
        else:
            raise AssertionError(f"{' '.join(words)} --help did not reach a tyro parser")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # get_parser: the parser --help prints
        parser = tyro.extras.get_parser(cls, **kwargs)
    options = []
    for action in parser._actions:
        if "-h" in action.option_strings:
            continue
        names = tuple(action.option_strings) or (action.dest,)
        options.append(Option(names, _kind(action), action.nargs in ("*", "+")))
    return options


def _kind(action: Any) -> str:
    if not action.option_strings:
        return "positional"
    if action.nargs == 0:
        return "flag"
    choices = {str(c) for c in action.choices or ()}
    if {"True", "False"} <= choices:
        return "bool"
    if choices:
        return "choice"
    metavar = str(action.metavar or "")
    for token, kind in (("INT", "int"), ("FLOAT", "float")):
        if token in metavar:
            return kind
    return "str"


# (what is wrong, the value as it reaches argv). "\udcff" is how Python hands the program an argv byte
# that is not UTF-8 (surrogate escape).
NUMBER_VALUES = {
    "int": [("negative", "-1"), ("huge", "9" * 30), ("wrong-typed", "1.5"), ("non-finite", "inf")],
    "float": [("non-finite", "nan"), ("non-finite", "inf"), ("negative", "-1"), ("huge", "1e999"),
              ("wrong-typed", "abc")],
}
OTHER_VALUES = {
    "str": [("non-UTF-8", "\udcff")],
    "choice": [("wrong-typed", "nope")],
    "bool": [("wrong-typed", "maybe")],
}


def bad_values(option: Option) -> list[tuple[str, str]]:
    """(what is wrong, value) pairs for `option`'s kind; none for a flag (it takes no value)."""
    return NUMBER_VALUES.get(option.kind, []) + OTHER_VALUES.get(option.kind, [])


# The same kinds as a TOML job file spells them (a string where a number goes, a number where text goes).
TOML_VALUES = {
    "int": [("negative", "-1"), ("huge", "9" * 30), ("wrong-typed", "1.5"), ("non-finite", "inf")],
    "float": [("non-finite", "nan"), ("non-finite", "inf"), ("negative", "-1.0"), ("huge", "1e999"),
              ("wrong-typed", '"abc"')],
    "str": [("wrong-typed", "7")],
    "choice": [("wrong-typed", '"nope"')],
    "bool": [("wrong-typed", '"maybe"')],
}


def bad_toml_values(option: Option) -> list[tuple[str, str]]:
    """(what is wrong, TOML value) pairs for `option`'s kind; a list option gets each inside a list."""
    return [(what, f"[{value}]" if option.many else value) for what, value in TOML_VALUES.get(option.kind, [])]


def toml_lines(values: dict[str, Any], prefix: str = "") -> list[str]:
    """`values` (nested dicts) as root-level dotted TOML keys, None left out."""
    lines = []
    for key, value in values.items():
        if isinstance(value, dict):
            lines += toml_lines(value, f"{prefix}{key}.")
        elif value is not None:
            literal = ("true" if value else "false") if isinstance(value, bool) else \
                json.dumps(value) if isinstance(value, (str, list, tuple)) else repr(value)
            lines.append(f"{prefix}{key} = {literal}")
    return lines


def bad_files(root: Path) -> dict[str, dict[str, str]]:
    """Bad inputs and outputs under `root`: {"input": {kind: path}, "output": {kind: path}}."""
    root.mkdir(parents=True, exist_ok=True)
    regular = root / "a_file.txt"
    regular.write_text("a file\n")
    (root / "a_dir").mkdir(exist_ok=True)
    fifo = root / "a_fifo"
    if not fifo.exists():
        os.mkfifo(fifo)
    (root / "binary.json").write_bytes(b"\xff\xfe\x00\x80" * 256)
    (root / "truncated.json").write_text('{"model_type": "deepseek_v3", "hidden_size": 6')
    (root / "nested.json").write_text("[" * 100_000 + "]" * 100_000)
    inputs = {"a directory": str(root / "a_dir"), "a FIFO": str(fifo), "/dev/zero": "/dev/zero",
              "non-UTF-8": str(root / "binary.json"), "truncated": str(root / "truncated.json"),
              "deeply nested": str(root / "nested.json")}
    outputs = {"below a file": str(regular / "out"), "unwritable": "/proc/moetrain_sweep_out"}
    return {"input": inputs, "output": outputs}


@dataclasses.dataclass
class Outcome:
    code: int | None
    lines: list[str]  # stderr's non-empty lines
    accepted: bool  # a hook at the start of the command's work was reached
    escaped: str  # the exception that left `main` (the console script's traceback), "" if none

    def describe(self) -> str:
        if self.escaped:
            return f"escaped {self.escaped}"
        return f"exit {self.code}{' (accepted)' if self.accepted else ''}: {' | '.join(self.lines)[:300]}"


@contextlib.contextmanager
def memoized_source() -> Iterator[None]:
    """inspect's source lookups answered once per object for the block. tyro reads each options class's
    source for its help text on every parse (an ast walk of the whole module: 0.1-0.3 s a command line);
    the files do not change during a sweep, so the cases pay it once."""
    saved = {}
    for name in ("getsource", "getsourcelines", "findsource"):
        real = saved[name] = getattr(inspect, name)
        answers: dict[int, tuple[Any, Any]] = {}

        def memoized(obj: Any, _real: Callable[[Any], Any] = real, _answers: dict = answers) -> Any:
            if id(obj) not in _answers:
                _answers[id(obj)] = (obj, _real(obj))  # the object kept alive, so its id stays its own
            return _answers[id(obj)][1]

        setattr(inspect, name, memoized)
    try:
        yield
    finally:
        for name, real in saved.items():
            setattr(inspect, name, real)


_CAPTURE: list[Any] = []


def _capture_file() -> Any:
    """One file for every case's stderr, never closed: a log handler a command binds to sys.stderr during one
    case keeps a file it can write to in the next (a closed one prints "--- Logging error ---")."""
    if not _CAPTURE:
        _CAPTURE.append(tempfile.TemporaryFile("w+", errors="replace"))
    return _CAPTURE[0]


class _Timeout(BaseException):
    pass


def _on_alarm(signum: int, frame: Any) -> None:
    raise _Timeout


@contextlib.contextmanager
def _memory_cap(extra_bytes: int) -> Iterator[None]:
    """At most `extra_bytes` more address space for the block: a command that reads /dev/zero to its end
    ends in MemoryError (a failed case), not in the kernel killing the whole test process."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/status") as status:
        size_kb = next(int(line.split()[1]) for line in status if line.startswith("VmSize:"))
    cap = size_kb * 1024 + extra_bytes
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def run_case(main: Main, argv: list[str], timeout_s: float = 20.0, memory_bytes: int = 2 << 30) -> Outcome:
    """`main(argv)` in this process with stderr (file descriptor 2 and sys.stderr) captured, a time limit and
    at most `memory_bytes` more address space."""
    saved_fd, saved_stderr = os.dup(2), sys.stderr
    code: int | None = None
    accepted, escaped = False, ""
    err_file = _capture_file()
    err_file.seek(0)
    err_file.truncate()
    os.dup2(err_file.fileno(), 2)
    sys.stderr = err_file
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        with _memory_cap(memory_bytes):
            code = main(list(argv))
    except Accepted:
        accepted = True
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 2
    except _Timeout:
        escaped = f"timeout after {timeout_s} s"
    except BaseException as err:  # noqa: BLE001 - what the console script would print as a traceback
        escaped = f"{type(err).__name__}: {str(err)[:200]}"
        traceback.print_exc()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        sys.stderr.flush()
        sys.stderr = saved_stderr
        os.dup2(saved_fd, 2)
        os.close(saved_fd)
    err_file.seek(0)
    lines = [line for line in err_file.read().splitlines() if line.strip()]
    return Outcome(code, lines, accepted, escaped)


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and directory under `root` -> (size, mtime in ns): a refused case must leave it unchanged."""
    found: dict[str, tuple[int, int]] = {}
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(directory, name)
            stat = os.lstat(path)
            found[path] = (stat.st_size if name in files else 0, stat.st_mtime_ns if name in files else 0)
    return found
