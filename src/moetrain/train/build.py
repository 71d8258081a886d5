"""The one model builder: config -> model on the meta device -> parallelized -> materialised -> weights.

Every place that needs a model (the trainer, export, sampling, the init report, Hugging Face
import, benchmarks and tests) builds it here, so the order that matters is written once:
expert parallelism, activation checkpointing, compile and FSDP are applied while the model is
still on the meta device (no memory is spent on parameters a rank will not hold), then
`to_empty` gives each rank its shards, and only then are weights drawn or read.

Weights: "init" draws them with the model's init scheme (each rank its own shards, the same
distribution as an unsharded init); "hf:DIR" reads a Hugging Face directory (each rank reads
its own slices); "none" leaves the parameters for the caller to load from a checkpoint and
resets only the buffers a checkpoint does not carry. Under pipeline parallelism `build_pipeline`
builds a rank's stages the same way, each stage parallelized (float8 included) as a model of its own. This module
builds; it does not train, save or parse a command line.

LoRA (`lora.rank > 0`): the adapters are added and the base frozen (in the compute dtype) on the meta
device, before parallelism, so EP and FSDP shard them with the weights they adapt; once the weights are
in, the adapters start as PEFT starts them, or from `lora.init_from`'s PEFT adapter directory.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from moetrain.checkpoint.layout import CheckpointRef
from moetrain.checkpoint.lora_base import STATE_KEY, check_base_identity
from moetrain.checkpoint.storage import load_model_weights
from moetrain.config.job import JobConfig
from moetrain.config.lora import LoraConfig
from moetrain.config.model import ModelConfig
from moetrain.config.parallel import ParallelConfig
from moetrain.dtypes import DTYPES
from moetrain.errors import ConfigError
from moetrain.interop import hf_job_config, load_hf_weights
from moetrain.interop.peft_adapter import load_peft_adapter
from moetrain.model.init import reset_buffers
from moetrain.model.lora import apply_lora, init_adapters
from moetrain.model.transformer import Transformer
from moetrain.parallel.mesh import JobMesh
from moetrain.parallel.parallelize import parallelize_model
from moetrain.parallel.pipeline import PipelineModel, pipeline_parts

WEIGHTS = ("init", "none", "hf:DIR")


def build_model(model_cfg: ModelConfig, parallel_cfg: ParallelConfig | None = None, job: JobMesh | None = None,
                device: torch.device | str = "cpu", *, weights: str = "init", seed: int = 0,
                init_scheme: str | None = None, activation_checkpointing: bool | str = False,
                compile: bool = False, activation_checkpointing_every: int = 1, float8: str = "none",
                lora: LoraConfig | None = None) -> Transformer:
    """The model of `model_cfg`, parallelized over the job's mesh per `parallel_cfg`, on `device`, with `weights`.

    `lora` (rank > 0) adds adapters (PEFT's start; "none" leaves them for the checkpoint too) and freezes
    the rest. Without a mesh (or on one rank without expert parallelism) the model stays a plain module.
    Collective when the model is sharded: every rank of the mesh calls it with the same arguments.
    """
    if weights not in ("init", "none") and not weights.startswith("hf:"):
        raise ConfigError(f"weights = {weights!r} is invalid: must be one of {', '.join(WEIGHTS)}")
    with torch.device("meta"):
        model = Transformer(model_cfg)
    parallel_cfg = parallel_cfg or ParallelConfig()
    if lora is not None and lora.enabled:
        apply_lora(model, lora, frozen_dtype=DTYPES[parallel_cfg.param_dtype])
    parallelize_model(model, job, parallel_cfg, activation_checkpointing=activation_checkpointing,
                      compile=compile, activation_checkpointing_every=activation_checkpointing_every,
                      device_type=torch.device(device).type, float8=float8)
    model.to_empty(device=device)
    _fill_weights(model, weights, seed, init_scheme)
    return model


def _fill_weights(model: Transformer, weights: str, seed: int, init_scheme: str | None) -> None:
    if weights == "none":
        reset_buffers(model)
    else:
        # Under "hf:DIR" the draw is overwritten; it still runs so that the random state after
        # building is the same whether or not weights come from a directory.
        model.init_weights(seed=seed, scheme=init_scheme)
        if weights.startswith("hf:"):
            load_hf_weights(model, weights)
        init_adapters(model, seed=seed)


def build_pipeline(cfg: JobConfig, job: JobMesh, *, weights: str | None = None) -> PipelineModel:
    """This pipeline rank's stages (`moetrain.parallel.pipeline`), each parallelized as its own model (TP/CP-split
    on the job's tp and cp sub-meshes as a whole model is, then FSDP), with
    `weights` (default `model.init_from` or "init") drawn or read through the rank's whole part, so by the
    names the whole model has: the same weights as one process builds (from "hf:DIR" each rank reads its
    own layers' tensors only). In train mode. Collective."""
    weights = weights or cfg.model.init_from or "init"
    if weights not in ("init", "none") and not weights.startswith("hf:"):
        raise ConfigError(f"weights = {weights!r} is invalid: must be one of {', '.join(WEIGHTS)}")
    pipeline = pipeline_parts(cfg.model, cfg.parallel, job.pipeline.get_local_rank())
    # A stage keeps its gathered weights from a microbatch's forward to its backward: resharding would
    # all-gather every layer twice per microbatch, and torch's split backward (ZBVZeroBubble) collects
    # a stage's weight gradients by the module's registered parameters, which must be the gathered ones.
    parallel = dataclasses.replace(cfg.parallel, reshard_after_forward=False)
    if cfg.lora.enabled:  # the parts share `model`'s modules: each stage's adapters live with its layers
        apply_lora(pipeline.model, cfg.lora, frozen_dtype=DTYPES[cfg.parallel.param_dtype])
    for part in pipeline.parts:
        parallelize_model(part, job, parallel, activation_checkpointing=cfg.train.activation_checkpointing,
                          compile=cfg.train.compile,
                          activation_checkpointing_every=cfg.train.activation_checkpointing_every,
                          device_type=job.device.type, float8=cfg.train.float8)
        part.to_empty(device=job.device)
    _fill_weights(pipeline.model, weights, cfg.train.seed, None)
    if cfg.lora.init_from is not None:  # each stage reads its own layers' adapters
        load_peft_adapter(pipeline.model, cfg, cfg.lora.init_from)
    pipeline.model.train()
    return pipeline


def build_for_job(cfg: JobConfig, job: JobMesh) -> Transformer:
    """The model a training job starts from: `model.init_from` when set, else a fresh init, in train mode."""
    model = build_model(cfg.model, cfg.parallel, job, job.device, weights=cfg.model.init_from or "init",
                        seed=cfg.train.seed, activation_checkpointing=cfg.train.activation_checkpointing,
                        compile=cfg.train.compile,
                        activation_checkpointing_every=cfg.train.activation_checkpointing_every,
                        float8=cfg.train.float8, lora=cfg.lora)
    if cfg.lora.init_from is not None:
        load_peft_adapter(model, cfg, cfg.lora.init_from)
    model.train()
    return model


def load_hf_model(model_dir: str | Path, device: torch.device | str = "cpu") -> tuple[Transformer, JobConfig]:
    """(model, JobConfig) of a Hugging Face directory in one process: the architecture from config.json,
    the weights from its safetensors files, its tokenizer as `data.tokenizer` when it has one."""
    cfg = hf_job_config(model_dir)
    model = build_model(cfg.model, device=device, weights=f"hf:{model_dir}")
    return model, cfg


def model_of_run(cfg: JobConfig, ref: CheckpointRef, parallel_cfg: ParallelConfig | None = None,
                 job: JobMesh | None = None, device: torch.device | str = "cpu") -> Transformer:
    """A training run's model at checkpoint `ref` (collective when sharded). A LoRA run's checkpoint holds its
    adapters only: the base is `model.init_from` (or the run's seeded draw) again, checked against the base
    the checkpoint records (one ConfigError line when it is another)."""
    weights = (cfg.model.init_from or "init") if cfg.lora.enabled else "none"  # else all from the checkpoint
    model = build_model(cfg.model, parallel_cfg, job, device, weights=weights, seed=cfg.train.seed, lora=cfg.lora)
    trainer_state = load_model_weights(ref, model)
    if cfg.lora.enabled:
        check_base_identity(trainer_state.get(STATE_KEY), cfg, ref.path)
    return model
