"""`moetrain export-hf --run-dir RUN [--step N] --out DIR`: a training run's checkpoint as a Hugging Face directory.

Reads the config the run stored, builds the model sharded over this invocation's ranks (the run's
mesh and expert parallelism when they fit the world size, else plain FSDP over all ranks; one
process works too), loads
the checkpoint's model weights shard by shard and writes them with `moetrain.interop.save_hf`:
safetensors files with per-expert tensors, config.json and the run's tokenizer. No rank holds
the whole model. Run it under `torchrun` to spread a large model over several processes.
Everything is checked (family fits, checkpoint exists, output directory is new) before anything
is written, and everything is written into a hidden directory beside --out that becomes --out by one
rename at the end: an export that fails or is stopped leaves no half-written --out. A run on
conversations exports the chat template its shards were rendered with (the manifest's text, checked
against its sha256), not whatever the tokenizer directory holds now.

A LoRA run (`lora.rank > 0`) checkpoints its adapters only: the base comes from the run's
`model.init_from` again (checked against the base the checkpoint records), and `--lora` chooses the
output: "merged" (the default) folds the adapters into the weights and writes the Hugging Face model
as above; "adapter" writes a PEFT adapter directory (adapter_config.json, adapter_model.safetensors)
for `peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), OUT)`.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import torch.distributed as dist
import tyro

from moetrain.args import parse_typed_args
from moetrain.checkpoint.layout import CheckpointRef, latest_complete, list_complete
from moetrain.config.job import JobConfig
from moetrain.data.chat import load_chat_template, template_sha256
from moetrain.data.shards import read_manifest
from moetrain.dtypes import DTYPES
from moetrain.errors import ConfigError
from moetrain.interop import FAMILIES, check_output_dir, export_family, save_hf
from moetrain.interop.peft_adapter import save_peft_adapter
from moetrain.model.lora import merge_adapters
from moetrain.parallel.collectives import barrier
from moetrain.parallel.mesh import JobMesh, MeshDims
from moetrain.parallel.process_group import init_distributed, owned_process_group
from moetrain.runtime.disk import no_space_left
from moetrain.runtime.run_dir import RunDir
from moetrain.train.build import model_of_run


@dataclass
class ExportOptions:
    """Write a training run's checkpoint as a Hugging Face model directory (a family of the registry)."""

    run_dir: Annotated[str, tyro.conf.arg(aliases=("--run",))]
    """Run directory of a training job (its logging.run_dir). Under torchrun spell it --run-dir: torchrun
    takes --run for an abbreviation of its own --run-path."""
    out: str  # new directory to write (must not exist or be empty)
    step: int | None = None  # checkpoint step; None = the newest complete checkpoint
    dtype: Literal["float32", "bfloat16"] | None = None  # dtype of the written tensors; None = the parameters'
    lora: Literal["merged", "adapter"] | None = None
    """A LoRA run: "merged" (default) writes the model with the adapters folded in, "adapter" a PEFT adapter
    directory."""


DESCRIPTION = ("Write a training run's checkpoint as a Hugging Face model directory (a family of the registry: "
               f"{', '.join(family.label for family in FAMILIES.values())}).")


def checkpoint_ref(run_dir: RunDir, step: int | None, run: str) -> CheckpointRef:
    if step is None:
        ref = latest_complete(run_dir.checkpoints)
        if ref is None:
            raise ConfigError(f"--run-dir {run!r} has no complete checkpoint under {run_dir.checkpoints}")
        return ref
    refs = {r.step: r for r in list_complete(run_dir.checkpoints)}
    if step not in refs:
        raise ConfigError(f"--step {step} is invalid: --run-dir {run!r} has complete checkpoints at steps "
                          f"{sorted(refs) or 'none'}")
    return refs[step]


def trained_chat_template(cfg: JobConfig) -> str | None:
    """The chat template the run's conversations were rendered with (None: text data, or shards no longer there).

    The manifest's own text when it has one matching its sha256; else (shards prepared before the manifest
    held the text) the template the run's data section names now, refused when its sha256 has changed.
    """
    if cfg.data.source != "tokens":
        return None
    for root in [path for path, _ in cfg.data.mixture_weights()] or [cfg.data.path or ""]:
        try:
            chat = read_manifest(Path(root)).get("chat")
        except ConfigError:
            continue
        if not chat:
            return None
        text = chat.get("template")
        if isinstance(text, str) and template_sha256(text) == chat["template_sha256"]:
            return text
        current = load_chat_template(cfg.data.tokenizer, cfg.data.chat_template)
        if current.sha256 != chat["template_sha256"]:
            raise ConfigError(f"the chat template of data.tokenizer = {cfg.data.tokenizer!r} has changed since "
                              f"{root} was prepared (sha256 {current.sha256[:12]}, manifest "
                              f"{chat['template_sha256'][:12]}): restore the one the run trained with")
        return current.text
    return None


@contextmanager
def staged_directory(out: str) -> Iterator[Path]:
    """A hidden directory beside `out`, renamed to `out` when the block succeeds and removed when it fails
    (on every rank the same path; rank 0 creates, renames and removes it)."""
    final = Path(out)
    staging = final.parent / f".{final.name}.partial"
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)  # the leftover of an export that was killed
    barrier()
    try:
        yield staging
        barrier()
        if rank == 0:
            os.replace(staging, final)  # onto a missing or empty --out: one rename, never half there
    except BaseException:
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        raise


def export(args: ExportOptions) -> Path:
    run_dir = RunDir(Path(args.run_dir))
    cfg = run_dir.load_config()
    export_family(cfg.model)
    if args.lora is not None and not cfg.lora.enabled:
        raise ConfigError(f"--lora {args.lora} is invalid: --run-dir {args.run_dir!r} trained without adapters "
                          "(lora.rank = 0); leave --lora out")
    ref = checkpoint_ref(run_dir, args.step, args.run_dir)
    check_output_dir(args.out)
    template = trained_chat_template(cfg)
    with owned_process_group(), tempfile.TemporaryDirectory() as scratch:
        if template is not None:  # written by save_hf from this file, whatever the directory holds now
            (Path(scratch) / "chat_template.jinja").write_text(template, encoding="utf-8")
            cfg.data = dataclasses.replace(cfg.data, chat_template=str(Path(scratch) / "chat_template.jinja"))
        _, world, device = init_distributed(cfg.parallel)
        # Sharded parameters keep their own dtype whatever the compute policy: export them as stored.
        parallel = dataclasses.replace(cfg.parallel, param_dtype="float32", reduce_dtype="float32", output_dtype=None)
        try:
            dims = MeshDims.from_config(parallel, world)
        except ConfigError:  # the run's mesh does not fit this world: plain FSDP over all of it (DCP reshards)
            parallel = dataclasses.replace(parallel, dp_replicate=1, dp_shard=-1, ep=1, tp=1, cp=1, pp=1)
            dims = MeshDims.from_config(parallel, world)
        job = JobMesh.build(dims, device)
        model = model_of_run(cfg, ref, parallel, job, device)
        with no_space_left(args.out, "Hugging Face export"), staged_directory(args.out) as staging:
            if args.lora == "adapter":
                save_peft_adapter(model, cfg, staging)
            else:
                merge_adapters(model)
                save_hf(model, cfg, staging, dtype=DTYPES[args.dtype] if args.dtype else None)
        if dist.get_rank() == 0:
            how = ("peft's PeftModel.from_pretrained on the base" if args.lora == "adapter" else
                   "transformers' AutoModelForCausalLM.from_pretrained")
            print(f"wrote {args.out} from {ref.path} (load it with {how})")
        barrier()
        return Path(args.out)


def main(argv: list[str]) -> int:
    options = parse_typed_args(ExportOptions, argv, "moetrain export-hf", description=DESCRIPTION)
    if options.step is not None and options.step < 0:
        raise ConfigError(f"--step = {options.step} is invalid: must be >= 0 (a checkpoint's step)")
    export(options)
    return 0
