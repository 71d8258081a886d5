"""`moetrain config --from-hf DIR`: a complete, commented TOML job that fine-tunes a Hugging Face directory.

The architecture and tokenizer come from DIR (moetrain.interop.hf_job_config), every other field is
the built-in default; above each field its documentation (the field's docstring, as `--help` shows
it). The output is a starting point to edit; `moetrain train --model.init_from hf:DIR` needs none of
it. Reads DIR/config.json only and writes only to stdout.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated

import tyro

from moetrain.args import option_help, parse_typed_args
from moetrain.config.job import JobConfig, to_toml
from moetrain.interop import hf_job_config

DEFAULT_SUFFIX = re.compile(r"\s*\(default: .*\)\s*$", re.DOTALL)


@dataclass
class ConfigOptions:
    """Print a complete, commented TOML job for fine-tuning a Hugging Face model directory."""

    from_hf: Annotated[str, tyro.conf.arg(name="from-hf")]
    """A Hugging Face model directory (config.json, safetensors, tokenizer.json)."""


def field_comments() -> dict[str, str]:
    """"section.field" -> its documentation as `moetrain train --help` shows it, without the default."""
    return {name[2:]: DEFAULT_SUFFIX.sub("", text) for name, text in option_help(JobConfig).items()
            if name.startswith("--") and "." in name}


def main(argv: list[str]) -> int:
    args = parse_typed_args(ConfigOptions, argv, "moetrain config")
    cfg = hf_job_config(args.from_hf)
    print(f"# moetrain job fine-tuning {args.from_hf} (moetrain config --from-hf); train it with\n"
          f"# moetrain train --config THIS_FILE\n")
    print(to_toml(cfg, field_comments()), end="")
    return 0
