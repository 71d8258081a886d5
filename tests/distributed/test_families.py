"""Every Hugging Face family on 4 gloo ranks (HSDP 2×2, and expert parallelism over 2 ranks of a 1×4 mesh),
against one process.

One spawn of 4 ranks serves every check; this process, as a 1-rank group, the reference round trips:
- global-batch balance loss, for grouped-query attention with softmax routing and for multi-head latent
  attention with group-limited sigmoid routing, a shared expert and a dense first layer (`BALANCE_CFGS`):
  every rank holds 2 microbatches of 1 sequence of an 8-sequence batch; the step's loss terms and
  gradients equal a float64 single-process step on the whole batch in one microbatch (where the
  global and per-microbatch forms coincide);
- sharded import (`FOUR_RANK_RUNS`, tiny models of `hf_tiny.VARIANTS`): the Trainer builds the model on
  the mesh from a directory (`model.init_from`), each rank reading its own shards and experts, kept in
  the interleaved RoPE layout (q/k rows and their biases permuted across shards) where the family allows:
  its weights equal a one-process import and its logits transformers' own. With EP each rank's 3
  experts are FSDP-sharded on dim 1 over the 2 ranks holding them; GPT-OSS's interleaved gate/up
  experts, their biases and the sinks are read into FSDP shards;
- sharded export: a checkpoint written by the 4 ranks, exported by `moetrain export-hf` on those
  ranks, gives bit for bit the original directory's tensors (as does the same round trip on 1 rank),
  and `from_pretrained` loads it with the one-process logits.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

import hf_tiny
from moetrain.checkpoint.checkpointer import Checkpointer
from moetrain.commands.export_hf import ExportOptions, export
from moetrain.config.job import JobConfig
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.data.dataset import load_training_data
from moetrain.data.packing import IGNORE_INDEX, Batch
from moetrain.interop import hf_job_config, load_hf_weights
from moetrain.model.transformer import Transformer
from moetrain.parallel.grad_sync import accumulation, resolve_sync_policy
from moetrain.parallel.mesh import JobMesh
from moetrain.runtime.run_dir import RunDir
from moetrain.testing import run_on_ranks
from moetrain.train.build import build_for_job
from moetrain.train.global_balance import prepare_global_balance
from moetrain.train.loss import microbatch_loss, router_loss_terms, token_loss_sum
from moetrain.train.trainer import Trainer
from stdlib_corpus import copy_stdlib_modules

BALANCE_CFG = ModelConfig(
    vocab_size=19, dim=16, n_layers=3, n_heads=2, n_dense_layers=1, ffn_hidden=12, qk_norm="per_head",
    max_seq_len=16, moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=6, impl="memory_efficient",
                                  aux_loss_coef=0.3, z_loss_coef=0.02, aux_loss_scope="global_batch"))
MLA_BALANCE_CFG = ModelConfig(
    vocab_size=19, dim=16, n_layers=3, n_heads=2, n_dense_layers=1, ffn_hidden=12, max_seq_len=16,
    kv_lora_rank=8, q_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6,
    moe=MoEConfig(n_experts=8, top_k=2, expert_hidden=6, n_shared_experts=1, score_func="sigmoid", n_group=4,
                  topk_group=2, routed_scaling_factor=2.5, impl="memory_efficient", aux_loss_coef=0.3,
                  z_loss_coef=0.02, aux_loss_scope="global_batch"))
# GPT-OSS's experts: biases on both projections (they travel with their experts under EP), a router bias.
BIAS_BALANCE_CFG = dataclasses.replace(BALANCE_CFG, moe=dataclasses.replace(
    BALANCE_CFG.moe, expert_proj_bias=True, router_bias=True, activation="clamped_swiglu"))
BALANCE_CFGS = {"gqa": BALANCE_CFG, "mla": MLA_BALANCE_CFG, "expert_biases": BIAS_BALANCE_CFG}
# Each balance model under HSDP 2x2, and FSDP 1x4 with 2 experts per EP rank.
BALANCE_LAYOUTS = {"hsdp_2x2": {"dp_replicate": 2}, "ep_2_on_1x4": {"ep": 2}}
# run name -> (tiny model of hf_tiny.VARIANTS, dp_replicate, ep): imported, checkpointed and exported on 4 ranks.
# With EP over 2 ranks of 1x4, each rank's 3 experts are FSDP-sharded on dim 1 over 2 ranks (3 rows do not split).
FOUR_RANK_RUNS = {
    "olmoe-hsdp": ("olmoe-clip-norm", 2, 1),
    "olmoe-ep": ("olmoe-clip-norm", 1, 2),
    "deepseek_v3-hsdp": ("deepseek_v3", 2, 1),
    "deepseek_v3-ep": ("deepseek_v3", 1, 2),
    "glm4_moe-hsdp": ("glm4_moe-fullrotary-bias", 2, 1),  # full rotary: kept in the interleaved layout
    # random expert biases travelling with their experts (2 per EP rank, FSDP over 2), the sinks sharded
    "gpt_oss-ep": ("gpt_oss", 1, 2),
}
# run name -> tiny model: the same round trip in this process alone.
ONE_RANK_RUNS = {"olmoe-one": "olmoe-clip-norm", "deepseek_v3-one": "deepseek_v3",
                 "glm4_moe-one": "glm4_moe-fullrotary-bias"}


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
    """Trainer from model.init_from on cfg's mesh; its full weights, logits and split parameters; checkpoint;
    export-hf."""
    rank, world = dist.get_rank(), dist.get_world_size()
    trainer = Trainer(cfg, load_training_data(cfg), JobMesh.from_config(cfg.parallel, world, "cpu"))
    sharded = [name for name, p in trainer.model.named_parameters()
               if isinstance(p, DTensor) and p.to_local().shape != p.shape]
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
    return {"weights": weights, "logits": logits, "sharded": sharded}


def family_worker(cfgs: list[JobConfig], balance_cfgs: list[JobConfig], logits_tokens: torch.Tensor) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict = {"balance": []}
    for balance_cfg in balance_cfgs:
        mesh = JobMesh.from_config(balance_cfg.parallel, world, "cpu")
        model = build_for_job(balance_cfg, mesh)
        batch = balance_batch()
        per_rank = 8 // world
        microbatches = [rows(batch, rank * per_rank + i, rank * per_rank + i + 1) for i in range(per_rank)]
        policy = resolve_sync_policy(balance_cfg.parallel, mesh.dims, len(microbatches))
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
    """(variant -> (transformers model, directory), logits tokens, 4-rank results, 1-rank results, tmp)."""
    tmp = tmp_path_factory.mktemp("families")
    corpus = copy_stdlib_modules(tmp / "corpus", ("bisect.py", "colorsys.py", "keyword.py"))
    models = {}
    for variant in dict.fromkeys(v for v, _, _ in FOUR_RANK_RUNS.values()):
        model = hf_tiny.build_variant(variant)
        models[variant] = (model, hf_tiny.save(model, tmp / variant))
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))  # GPT-OSS's window 5 < 20
    balance = []
    for model_cfg in BALANCE_CFGS.values():
        for layout in BALANCE_LAYOUTS.values():
            cfg = JobConfig(model=model_cfg)
            cfg.parallel.dp_replicate, cfg.parallel.ep = layout.get("dp_replicate", 1), layout.get("ep", 1)
            balance.append(cfg)
    jobs = [job(models[variant][1], tmp, corpus, name, replicate=replicate, ep=ep)
            for name, (variant, replicate, ep) in FOUR_RANK_RUNS.items()]
    four = to_torch(run_on_ranks(family_worker, 4, jobs, balance, tokens, timeout=900)[0])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # 1 rank: this process
    try:
        one = to_torch(family_worker([job(models[variant][1], tmp, corpus, name)
                                      for name, variant in ONE_RANK_RUNS.items()], [], tokens))
    finally:
        dist.destroy_process_group()
    return models, tokens, four, one, tmp


@pytest.mark.parametrize("attention", BALANCE_CFGS)
@pytest.mark.parametrize("layout", BALANCE_LAYOUTS)
def test_global_batch_balance_loss_on_4_ranks_equals_one_process_on_the_whole_batch(runs, attention, layout):
    four = runs[2]
    reference = Transformer(BALANCE_CFGS[attention]).double()
    reference.init_weights(seed=0)  # the sharded init equals the unsharded one bit for bit
    want_parts, want_grads = balance_step(reference, [balance_batch()])
    index = list(BALANCE_CFGS).index(attention) * len(BALANCE_LAYOUTS) + list(BALANCE_LAYOUTS).index(layout)
    got_parts, got_grads = four["balance"][index]
    torch.testing.assert_close(got_parts, want_parts, rtol=1e-6, atol=0)
    assert want_parts[1] > 0 and want_parts[2] > 0
    for name, want in want_grads.items():
        error = float((got_grads[name] - want).abs().max() / want.abs().max())
        assert error < 1e-5, (name, error)


@pytest.mark.parametrize("run", FOUR_RANK_RUNS)
def test_sharded_import_equals_one_process_and_transformers(runs, run):
    models, tokens, four, _, _ = runs
    hf_model, directory = models[FOUR_RANK_RUNS[run][0]]
    cfg = hf_job_config(directory)
    reference = Transformer(dataclasses.replace(cfg.model, rope_layout="interleaved"))
    load_hf_weights(reference, directory)
    for name, param in reference.named_parameters():
        assert torch.equal(four[run]["weights"][name], param.detach()), name
    with torch.no_grad():
        assert hf_tiny.relative_error(four[run]["logits"], hf_model(tokens).logits) < 1e-5


# family -> (its runs, a tensor name the original directory must hold for the check to mean what it says)
EXPORTS = {
    "olmoe": (["olmoe-hsdp", "olmoe-ep", "olmoe-one"], "model.layers.0.self_attn.q_norm.weight"),
    "deepseek_v3": (["deepseek_v3-hsdp", "deepseek_v3-ep", "deepseek_v3-one"],
                    "model.layers.2.mlp.gate.e_score_correction_bias"),
    "glm4_moe": (["glm4_moe-hsdp", "glm4_moe-one"], "model.layers.0.self_attn.q_proj.bias"),
    "gpt_oss": (["gpt_oss-ep"], "model.layers.0.mlp.experts.gate_up_proj_bias"),
}


@pytest.mark.parametrize("family", EXPORTS)
def test_exports_from_4_rank_checkpoints_equal_the_1_rank_round_trip_and_the_original(runs, family):
    from transformers import AutoModelForCausalLM

    models, tokens, four, one, tmp = runs
    names, held = EXPORTS[family]
    original = read_dir(models[FOUR_RANK_RUNS[names[0]][0]][1])
    assert held in original
    for name in names:
        tensors = read_dir(tmp / name / "hf")
        assert set(tensors) == set(original), name
        for key, tensor in original.items():
            assert torch.equal(tensors[key], tensor), (name, key)
        assert not (tmp / name / "hf" / "sharded").exists()
    reference = one.get(f"{family}-one", four[names[0]])["logits"]
    for name in (n for n in names if n in FOUR_RANK_RUNS):
        loaded, info = AutoModelForCausalLM.from_pretrained(tmp / name / "hf", output_loading_info=True)
        assert (info["missing_keys"], info["unexpected_keys"]) == (set(), set())
        with torch.no_grad():
            assert hf_tiny.relative_error(loaded.float().eval()(tokens).logits, reference) < 1e-5


def test_gpt_oss_experts_their_biases_and_the_sinks_are_split_over_the_shard_ranks(runs):
    assert {"layers.0.moe.experts.w1", "layers.0.moe.experts.b1", "layers.0.attention.sinks"} <= set(
        runs[2]["gpt_oss-ep"]["sharded"])
