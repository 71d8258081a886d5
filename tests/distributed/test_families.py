"""The Hugging Face families on 4 gloo ranks (HSDP 2×2), against one process.

One spawn of 4 ranks serves three checks; this process, as a 1-rank group, the reference round trip:
- global-batch balance loss (HSDP 2×2, and expert parallelism over 2 ranks of a 1×4 mesh): every
  rank holds 2 microbatches of 1 sequence of an 8-sequence batch; the step's loss terms and
  gradients equal a float64 single-process step on the whole batch in one microbatch (where the
  global and per-microbatch forms coincide);
- sharded import: the Trainer builds the model on the 2×2 mesh from an OLMoE directory
  (`model.init_from`), each rank reading its own shards and experts, kept in the interleaved RoPE
  layout (q/k rows permuted across shards): its weights equal a one-process import and its logits
  transformers' own;
- the same import on 4 ranks with expert parallelism over 2 (each rank's 3 experts FSDP-sharded on
  dim 1 over the 2 ranks holding them);
- sharded export: a checkpoint written by the 4 ranks (HSDP 2×2, and EP), exported by
  `moetrain export-hf` on those ranks, gives bit for bit the tensors of the same round trip on
  1 rank, which are the original directory's tensors.
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
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.data.corpus import stdlib_root
from moetrain.data.dataset import load_training_data
from moetrain.data.packing import IGNORE_INDEX, Batch
from moetrain.interop import hf_job_config, load_hf_weights
from moetrain.model.transformer import Transformer
from moetrain.parallel.grad_sync import accumulation, resolve_sync_policy
from moetrain.parallel.mesh import build_mesh
from moetrain.runtime.run_dir import RunDir
from moetrain.testing import run_on_ranks
from moetrain.train.build import build_for_job
from moetrain.train.checkpoint import Checkpointer
from moetrain.train.export_hf import ExportOptions, export
from moetrain.train.global_balance import prepare_global_balance
from moetrain.train.loss import microbatch_loss, router_loss_terms, token_loss_sum
from moetrain.train.trainer import Trainer

BALANCE_CFG = ModelConfig(
    vocab_size=19, dim=16, n_layers=3, n_heads=2, n_dense_layers=1, ffn_hidden=12, qk_norm="per_head",
    max_seq_len=16, moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=6, impl="memory_efficient",
                                  aux_loss_coef=0.3, z_loss_coef=0.02, aux_loss_scope="global_batch"))


def balance_batch() -> Batch:
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 19, (8, 10), generator=gen)
    targets = torch.randint(0, 19, (8, 10), generator=gen)
    targets[1, :4] = IGNORE_INDEX
    targets[5] = IGNORE_INDEX
    document_ids = (torch.arange(10) >= 6).long().expand(8, 10)
    positions = (torch.arange(10) - 6 * document_ids[0]).expand(8, 10)
    return Batch(tokens, positions, document_ids, targets)


def rows(batch: Batch, lo: int, hi: int) -> Batch:
    return Batch(*(t[lo:hi] for t in (batch.tokens, batch.positions, batch.document_ids, batch.targets)))


def balance_step(model, microbatches: list[Batch], policy=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One step as Trainer.train_step runs it: ([LM, balance, z] summed over ranks, full gradients)."""
    local_tokens = sum(b.n_valid_targets for b in microbatches)
    global_tokens = local_tokens
    if dist.is_initialized():
        count = torch.tensor([local_tokens])
        dist.all_reduce(count)
        global_tokens = int(count)
    prepare_global_balance(model, microbatches)
    parts = torch.zeros(3, dtype=torch.float64)
    loop = accumulation(model, microbatches, policy) if policy else ((b, False) for b in microbatches)
    for b, _ in loop:
        loss_sum, n_valid = token_loss_sum(model(b.tokens, b.positions, b.document_ids), b.targets)
        aux, z = model.aux_loss(), model.z_loss_sum(b.targets != IGNORE_INDEX)
        microbatch_loss(loss_sum, n_valid, global_tokens, aux, z, True).backward()
        balance, z_term = router_loss_terms(n_valid, global_tokens, aux.detach(), z.detach(), True)
        parts += torch.tensor([float(loss_sum.detach()) / global_tokens, float(balance), float(z_term)],
                              dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(parts)
    grads = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).double()
             for name, p in model.named_parameters()}
    return parts, grads


def import_checkpoint_export(cfg: JobConfig, logits_tokens: torch.Tensor) -> dict:
    """Trainer from model.init_from on cfg's mesh; its full weights and logits; checkpoint; export-hf."""
    rank, world = dist.get_rank(), dist.get_world_size()
    trainer = Trainer(cfg, load_training_data(cfg), build_mesh(cfg.parallel, world, "cpu"), torch.device("cpu"))
    weights = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
               for name, p in trainer.model.named_parameters()}
    with torch.no_grad():
        logits = trainer.model(logits_tokens)
    run_dir = RunDir(Path(cfg.logging.run_dir))
    if rank == 0:
        run_dir.root.mkdir(parents=True, exist_ok=True)
        run_dir.config.write_text(json.dumps(cfg.to_dict()))
    Checkpointer(run_dir.checkpoints, cfg.checkpoint, 1, cfg.logging.run_dir).maybe_save(1, trainer)
    export(ExportOptions(run_dir=cfg.logging.run_dir, out=str(run_dir.root / "hf")))
    return {"weights": weights, "logits": logits}


def family_worker(cfgs: list[JobConfig], balance_cfgs: list[JobConfig], logits_tokens: torch.Tensor) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict = {"balance": []}
    for balance_cfg in balance_cfgs:
        mesh = build_mesh(balance_cfg.parallel, world, "cpu")
        model = build_for_job(balance_cfg, mesh, torch.device("cpu"))
        batch = balance_batch()
        per_rank = 8 // world
        microbatches = [rows(batch, rank * per_rank + i, rank * per_rank + i + 1) for i in range(per_rank)]
        policy = resolve_sync_policy(balance_cfg.parallel, mesh, len(microbatches))
        result["balance"].append(balance_step(model, microbatches, policy))
    for cfg in cfgs:
        result[Path(cfg.logging.run_dir).name] = import_checkpoint_export(cfg, logits_tokens)
    # numpy, not tensors: torch pickles tensors as shared-memory handles that die with the rank.
    return to_numpy(result) if rank == 0 else {}


def to_numpy(value):
    if isinstance(value, torch.Tensor):
        return value.detach().numpy()
    if isinstance(value, dict):
        return {k: to_numpy(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return type(value)(to_numpy(v) for v in value)
    return value


def to_torch(value):
    if isinstance(value, dict):
        return {k: to_torch(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return type(value)(to_torch(v) for v in value)
    return torch.from_numpy(value) if hasattr(value, "dtype") else value


def job(directory: Path, tmp: Path, corpus: Path, name: str, replicate: int = 1, ep: int = 1) -> JobConfig:
    cfg = hf_job_config(directory)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, rope_layout="interleaved"))
    cfg.parallel.dp_replicate, cfg.parallel.ep = replicate, ep
    cfg.data.source, cfg.data.path, cfg.data.glob, cfg.data.seq_len = "dir", str(corpus), "*.py", 32
    cfg.train.steps, cfg.train.warmup_steps, cfg.train.microbatch_size = 1, 0, 2
    cfg.logging.run_dir, cfg.logging.progress_bar = str(tmp / name), False
    return cfg.validate()


def read_dir(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("families")
    corpus = tmp / "corpus"
    corpus.mkdir()
    for name in ("bisect.py", "colorsys.py", "keyword.py"):
        shutil.copyfile(stdlib_root() / name, corpus / name)
    hf_model = hf_tiny.build("olmoe", seed=11, clip_qkv=0.5)
    directory = hf_tiny.save(hf_model, tmp / "olmoe")
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    hsdp, ep = JobConfig(model=BALANCE_CFG), JobConfig(model=BALANCE_CFG)
    hsdp.parallel.dp_replicate, ep.parallel.ep = 2, 2  # HSDP 2x2; FSDP 1x4 with 2 experts per EP rank
    # HSDP 2x2; and FSDP 1x4 with expert parallelism over 2 ranks, where each rank's 3 experts are
    # FSDP-sharded on dim 1 over the 2 ranks holding them (3 rows do not split over 2)
    jobs = [job(directory, tmp, corpus, "hsdp", replicate=2), job(directory, tmp, corpus, "ep", ep=2)]
    four = to_torch(run_on_ranks(family_worker, 4, jobs, [hsdp, ep], tokens, timeout=300)[0])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # 1 rank: this process
    try:
        one = to_torch(family_worker([job(directory, tmp, corpus, "one")], [], tokens))
    finally:
        dist.destroy_process_group()
    return hf_model, directory, tokens, four, one, tmp


@pytest.mark.parametrize("layout", [0, 1], ids=["hsdp_2x2", "ep_2_on_1x4"])
def test_global_batch_balance_loss_on_4_ranks_equals_one_process_on_the_whole_batch(runs, layout):
    four = runs[3]
    reference = Transformer(BALANCE_CFG).double()
    reference.init_weights(seed=0)  # the sharded init equals the unsharded one bit for bit
    want_parts, want_grads = balance_step(reference, [balance_batch()])
    got_parts, got_grads = four["balance"][layout]
    torch.testing.assert_close(got_parts, want_parts, rtol=1e-6, atol=0)
    assert want_parts[1] > 0 and want_parts[2] > 0
    for name, want in want_grads.items():
        error = float((got_grads[name] - want).abs().max() / want.abs().max())
        assert error < 1e-5, (name, error)


@pytest.mark.parametrize("layout", ["hsdp", "ep"])
def test_sharded_import_equals_one_process_and_transformers(runs, layout):
    hf_model, directory, tokens, four, _, _ = runs
    cfg = hf_job_config(directory)
    reference = Transformer(dataclasses.replace(cfg.model, rope_layout="interleaved"))
    load_hf_weights(reference, directory)
    for name, param in reference.named_parameters():
        assert torch.equal(four[layout]["weights"][name], param.detach()), name
    with torch.no_grad():
        assert hf_tiny.relative_error(four[layout]["logits"], hf_model(tokens).logits) < 1e-5


def test_exports_from_4_rank_checkpoints_equal_the_1_rank_round_trip_and_the_original(runs):
    from transformers import AutoModelForCausalLM

    _, directory, tokens, _, one, tmp = runs
    original = read_dir(directory)
    exports = {name: read_dir(tmp / name / "hf") for name in ("hsdp", "ep", "one")}
    for name, tensors in exports.items():
        assert set(tensors) == set(original), name
        for key, tensor in original.items():
            assert torch.equal(tensors[key], tensor), (name, key)
        assert not (tmp / name / "hf" / "sharded").exists()
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp / "hsdp" / "hf", output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"]) == (set(), set())
    with torch.no_grad():
        assert hf_tiny.relative_error(loaded(tokens).logits, one["one"]["logits"]) < 1e-5
