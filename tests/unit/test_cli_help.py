"""`--help` tells the truth: each job option shows its own field's documentation (read from config/'s
source, docstring below the field or comment above it, independently of tyro), job commands list
--config and their own options, every subcommand has a full help, and no option a subcommand documents
is one that torchrun, in front of `-m moetrain`, would take for its own (argparse prefix-matches)."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import re
import typing
import warnings
from pathlib import Path

import pytest
import tyro

from moetrain import cli
from moetrain.config.job import JobConfig

CONFIG_SOURCES = sorted((Path(__file__).resolve().parents[2] / "src" / "moetrain" / "config").glob("*.py"))
HELP_SUFFIX = re.compile(r"\s*\((default|fixed to): .*\)\s*$|\s*\(required\)\s*$", re.DOTALL)


def field_documentation() -> dict[str, dict[str, str]]:
    """class name -> field -> its documentation in config/: the string below it, else the comments above it."""
    docs: dict[str, dict[str, str]] = {}
    for source in CONFIG_SOURCES:
        docs.update(class_field_documentation(source.read_text()))
    return docs


def class_field_documentation(text: str) -> dict[str, dict[str, str]]:
    """field_documentation for the classes of one source file."""
    lines = text.splitlines()
    docs: dict[str, dict[str, str]] = {}
    for node in ast.parse(text).body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields = docs.setdefault(node.name, {})
        for index, item in enumerate(node.body):
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            after = node.body[index + 1] if index + 1 < len(node.body) else None
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) \
                    and isinstance(after.value.value, str):
                fields[item.target.id] = after.value.value
                continue
            above, row = [], item.lineno - 2
            while row >= 0 and lines[row].strip().startswith("#"):
                above.insert(0, lines[row].strip().lstrip("#").strip())
                row -= 1
            fields[item.target.id] = " ".join(above)
    return docs


def job_options(cls: type = JobConfig, prefix: str = "--") -> dict[str, tuple[str, str]]:
    """--section.field -> (the dataclass that declares it, the field name), for every leaf of JobConfig."""
    hints = typing.get_type_hints(cls)
    out: dict[str, tuple[str, str]] = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(job_options(hints[f.name], f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = (cls.__name__, f.name)
    return out


def tyro_help(cls: type) -> dict[str, str]:
    """option -> the help tyro prints for it, as `moetrain train --help` builds it (moetrain.args)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        parser = tyro.extras.get_parser(cls, use_underscores=True, config=(tyro.conf.FlagConversionOff,))
    return {name: action.help or "" for action in parser._actions for name in action.option_strings}


def normalized(text: str) -> str:
    return " ".join(HELP_SUFFIX.sub("", text).split())


def test_every_job_option_shows_its_own_fields_documentation():
    docs, shown = field_documentation(), tyro_help(JobConfig)
    wrong = []
    for option, (owner, name) in job_options().items():
        want = normalized(docs[owner][name])
        got = normalized(shown.get(option, "<not listed>"))
        if not want or got != want:
            wrong.append(f"{option}: shows {got!r}, documented {want!r}")
    assert not wrong, f"{len(wrong)} options:\n" + "\n".join(wrong)


def captured_help(*command: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            code = cli.main([*command, "--help"])
        except SystemExit as stop:  # tyro ends a --help with SystemExit(0)
            code = stop.code
    assert code in (0, None), command
    return out.getvalue()


@pytest.mark.parametrize("command", [("train",), ("bench", "train")])
def test_job_commands_list_config_and_every_field(command):
    text = captured_help(*command)
    assert "--config FILE" in text and "TOML job file" in text
    for option in job_options():
        assert option in text, option
    if command == ("bench", "train"):
        assert "--steps INT" in text and "--warmup INT" in text and "--json" in text


SUBCOMMANDS = [(name,) for name in cli.SUBCOMMANDS if name != "bench"] + \
    [("bench", name) for name in ("moe", "sync", "ep", "attention", "data", "train")]


@pytest.mark.parametrize("command", SUBCOMMANDS, ids=" ".join)
def test_every_subcommand_has_a_full_help(command):
    text = captured_help(*command)
    options = set(re.findall(r"(--[A-Za-z][\w.-]*)", text)) - {"--help"}
    assert len(text.splitlines()) >= 5 and options, text


def torchrun_options() -> list[str]:
    from torch.distributed.run import get_args_parser

    return [name for action in get_args_parser()._actions for name in action.option_strings
            if name.startswith("--") and name != "--help"]


@pytest.mark.parametrize("command", SUBCOMMANDS, ids=" ".join)
def test_torchrun_cannot_take_a_subcommands_option(command):
    """Each documented option (or, on its help line, one of its spellings) is no prefix of a torchrun option."""
    theirs = torchrun_options()
    clashes = []
    for line in captured_help(*command).splitlines():
        line = line.strip("│ ")
        if not line.startswith("--"):  # an option's own line, not help text mentioning one
            continue
        names = set(re.findall(r"(?<![\w-])(--[A-Za-z][\w.-]*)", line)) - {"--help"}
        if names and all(any(t.startswith(n) for t in theirs) for n in names):
            clashes.append(f"{sorted(names)} in {line.strip()!r}")
    assert not clashes, clashes
