"""GPT-OSS's interleaved expert layout (and its biases and sinks) imported and exported sharded, on 4 gloo ranks.

The Trainer builds a GPT-OSS model on an HSDP 2×2 mesh from a transformers directory
(`model.init_from`), in the interleaved RoPE layout (q/k rows and biases permuted across shards),
each rank reading its own shards: the gate/up de-interleaving, the biases and the sinks are read
into FSDP shards. Its weights must equal a one-process import and its logits transformers' own;
a checkpoint of it exported by `moetrain export-hf` on the 4 ranks must give the original
directory's tensors bit for bit (the interleaving applied to shards, consolidated by DCP).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

import hf_tiny
from moetrain.config.job import JobConfig
from moetrain.data.corpus import stdlib_root
from moetrain.data.dataset import load_training_data
from moetrain.interop import hf_job_config, load_hf_weights
from moetrain.model.transformer import Transformer
from moetrain.parallel.mesh import build_mesh
from moetrain.runtime.run_dir import RunDir
from moetrain.testing import run_on_ranks
from moetrain.train.checkpoint import Checkpointer
from moetrain.train.export_hf import ExportOptions, export
from moetrain.train.trainer import Trainer


def worker(cfg: JobConfig, tokens: torch.Tensor) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    trainer = Trainer(cfg, load_training_data(cfg), build_mesh(cfg.parallel, world, "cpu"), torch.device("cpu"))
    sharded = [name for name, p in trainer.model.named_parameters()
               if isinstance(p, DTensor) and p.to_local().shape != p.shape]
    weights = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone().numpy()
               for name, p in trainer.model.named_parameters()}
    with torch.no_grad():
        logits = trainer.model(tokens).numpy()
    run_dir = RunDir(Path(cfg.logging.run_dir))
    if rank == 0:
        run_dir.root.mkdir(parents=True, exist_ok=True)
        run_dir.config.write_text(json.dumps(cfg.to_dict()))
    Checkpointer(run_dir.checkpoints, cfg.checkpoint, 1, cfg.logging.run_dir).maybe_save(1, trainer)
    export(ExportOptions(run_dir=cfg.logging.run_dir, out=str(run_dir.root / "hf")))
    return {"weights": weights, "logits": logits, "sharded": sharded} if rank == 0 else {}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpt_oss")
    corpus = tmp / "corpus"
    corpus.mkdir()
    for name in ("bisect.py", "colorsys.py", "keyword.py"):
        shutil.copyfile(stdlib_root() / name, corpus / name)
    hf_model = hf_tiny.build("gpt_oss", seed=4)
    directory = hf_tiny.save(hf_model, tmp / "gpt_oss")
    cfg = hf_job_config(directory)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, rope_layout="interleaved"))
    cfg.parallel.dp_replicate = 2
    cfg.data.source, cfg.data.path, cfg.data.glob, cfg.data.seq_len = "dir", str(corpus), "*.py", 32
    cfg.train.steps, cfg.train.warmup_steps, cfg.train.microbatch_size = 1, 0, 2
    cfg.logging.run_dir, cfg.logging.progress_bar = str(tmp / "hsdp"), False
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))  # window 5 < 20
    result = run_on_ranks(worker, 4, cfg.validate(), tokens, timeout=300)[0]
    return hf_model, directory, tokens, result, tmp


def test_sharded_import_equals_one_process_and_transformers(run):
    hf_model, directory, tokens, result, _ = run
    # the expert weights, their biases and the sinks really were split over the shard ranks
    assert {"layers.0.moe.experts.w1", "layers.0.moe.experts.b1", "layers.0.attention.sinks"} <= set(result["sharded"])
    reference = Transformer(dataclasses.replace(hf_job_config(directory).model, rope_layout="interleaved"))
    load_hf_weights(reference, directory)
    for name, param in reference.named_parameters():
        assert torch.equal(torch.from_numpy(result["weights"][name]), param.detach()), name
    with torch.no_grad():
        assert hf_tiny.relative_error(torch.from_numpy(result["logits"]), hf_model(tokens).logits) < 1e-5


def test_sharded_export_gives_the_original_tensors(run):
    _, directory, _, _, tmp = run
    original, exported = {}, {}
    for source, out in ((directory, original), (tmp / "hsdp" / "hf", exported)):
        for path in sorted(Path(source).glob("*.safetensors")):
            out.update(load_file(str(path)))
    assert set(exported) == set(original)
    for key, tensor in original.items():
        assert torch.equal(exported[key], tensor), key
