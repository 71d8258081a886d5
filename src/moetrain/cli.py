"""The `moetrain` command line: one subcommand per job, user errors as one line + exit 2.

Each subcommand is a function `main(argv) -> int` in the module that owns the work,
parsing its own options with tyro (`moetrain.args`). This file only dispatches: the
registry names each subcommand's module as a string and imports it when that
subcommand runs, so `moetrain --help` and a mistyped command answer without loading
torch. It turns `ConfigError` into a single `moetrain: error: ...` line with exit
status 2.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from typing import NoReturn

from moetrain.errors import ConfigError, ModelError
from moetrain.runtime.allocator import huge_pages_for_large_tensors

# name -> (one-line help, "module:function")
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("train a model from a TOML config (+ --section.field overrides)", "moetrain.train.run:main"),
    "sample": ("generate text from a run's latest checkpoint", "moetrain.commands.sample:main"),
    "plot": ("draw a run's loss and throughput curves to PNG", "moetrain.observe.plot:main"),
    # The families come from moetrain.interop.families, which loads torch: `export-hf --help` lists them.
    "export-hf": ("write a run's checkpoint as a Hugging Face model directory (families: `export-hf --help`)",
                  "moetrain.commands.export_hf:main"),
    "data": ("`data prepare`: tokenize text or conversations into memory-mapped token shards; `data verify DIR`",
             "moetrain.data.prepare.command:main"),
    "bench": ("benchmarks: `bench moe`, `bench sync`, `bench ep`, `bench attention`, `bench data`, `bench train`",
              "moetrain.bench:main"),
    "estimate": ("memory per rank (weights, gradients, optimizer, activations, peak) for a job and a mesh",
                 "moetrain.commands.estimate:main"),
    "config": ("`config --from-hf DIR`: a complete, commented TOML job for a Hugging Face directory",
               "moetrain.commands.config_from_hf:main"),
    "simulate": ("predict step time of the sync policies at cluster scale", "moetrain.bench.simulate:main"),
    "eval": ("evaluate a run's checkpoint or a Hugging Face directory with lm-evaluation-harness (extra `eval`)",
             "moetrain.commands.eval:main"),
    "init-report": ("per-parameter init distribution: intended vs measured std", "moetrain.commands.init_report:main"),
    "lighthouse": ("start the quorum server of a fault-tolerant HSDP run (torchft; [ft] section); prints its address",
                   "moetrain.commands.lighthouse:main"),
}

USAGE = "usage: moetrain COMMAND [options]   (moetrain COMMAND --help for a command's options)"
DESCRIPTION = "PyTorch-native trainer for fine-grained mixture-of-experts models (FSDP2/HSDP)."


def help_text() -> str:
    width = max(len(name) for name in SUBCOMMANDS)
    rows = [f"  {name:{width}}  {help_line}" for name, (help_line, _) in SUBCOMMANDS.items()]
    return "\n".join([USAGE, "", DESCRIPTION, "", "commands:", *rows])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(help_text())
        return 0
    if argv[0] not in SUBCOMMANDS:
        print(f"moetrain: error: unknown command {argv[0]!r}; valid commands: {', '.join(SUBCOMMANDS)}",
              file=sys.stderr)
        return 2
    module_name, func_name = SUBCOMMANDS[argv[0]][1].split(":")
    try:
        func = getattr(importlib.import_module(module_name), func_name)
        return int(func(argv[1:]) or 0)
    except (ConfigError, ModelError) as err:
        print(f"moetrain: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # `moetrain ... | head` closed the pipe: not an error; keep Python from complaining at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def entry() -> NoReturn:
    """The console script and `python -m moetrain`: run `main` and end the process with its code.

    One rank of a multi-rank job (torchrun sets WORLD_SIZE > 1) ends with `os._exit` once its
    output is flushed, skipping the interpreter's and C++ static teardown. gloo's worker threads
    outlive `destroy_process_group`; when the teardown reaches them, a rank can abort with
    "terminate called without an active exception" (SIGABRT) after a run that succeeded, and
    torchrun then reports the whole job as failed (1 in 49 two-rank runs did, with only a final
    barrier; benchmarks/stress/stress_exit.py). Every file the run writes is closed before `main` returns.
    Before anything loads torch, a rank of a multi-rank job asks for huge pages for large host
    tensors (moetrain.runtime.allocator).
    """
    huge_pages_for_large_tensors()  # read when torch loads, so before any subcommand imports it
    code = main()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        logging.shutdown()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe: nothing left to say
                pass
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":  # pragma: no cover
    entry()
