"""`moetrain config --from-hf DIR`: a complete, commented TOML job that fine-tunes a Hugging Face directory.

The architecture and tokenizer come from DIR (moetrain.interop.hf_job_config); the job is a fine-tuning
one: its run directory is named after the model (runs/NAME, not the default job's), the [data] section
is left for the user to fill in (prepared shards, `data.source = "tokens"`, whose `data.path` the job
refuses to start without), and the learning rate and schedule are fine-tuning ones (as
configs/finetune.toml), with no pre-training sample prompt. Every other field is the built-in default;
above each field its documentation (the field's docstring, as `--help` shows it). Reads DIR/config.json
only and writes only to stdout.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
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


# A fine-tuning run's training settings, as configs/finetune.toml: a small learning rate decaying to a
# tenth over a short cosine schedule, no weight decay, held-out loss every 50 steps, no text sample.
FINE_TUNING = {"steps": 200, "lr": 1e-4, "min_lr_ratio": 0.1, "warmup_steps": 20, "schedule": "cosine",
               "weight_decay": 0.0, "eval_every": 50, "sample_tokens": 0, "sample_prompt": ""}


def fine_tuning_job(cfg: JobConfig, model_dir: str) -> JobConfig:
    """The directory's job made a fine-tuning one (see the module doc); its data.path left to fill in."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(model_dir).resolve().name) or "model"
    return dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, **FINE_TUNING),
        data=dataclasses.replace(cfg.data, source="tokens", path=None),
        logging=dataclasses.replace(cfg.logging, run_dir=f"runs/{name}"),
        checkpoint=dataclasses.replace(cfg.checkpoint, every=100, keep_last=2))


def main(argv: list[str]) -> int:
    args = parse_typed_args(ConfigOptions, argv, "moetrain config")
    cfg = fine_tuning_job(hf_job_config(args.from_hf), args.from_hf)
    print(f"# moetrain job fine-tuning {args.from_hf} (moetrain config --from-hf). Fill in [data] first:\n"
          f"# prepare your text or conversations with `moetrain data prepare --tokenizer {cfg.data.tokenizer} "
          f"--out DIR ...`\n# and set data.path = DIR (or data.mixture). Then: moetrain train --config THIS_FILE\n")
    print(to_toml(cfg, field_comments()), end="")
    return 0
