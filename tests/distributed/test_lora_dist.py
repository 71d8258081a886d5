"""LoRA under FSDP 2 x EP 2 on 4 gloo ranks against one float64 process.

The parity grid's tiny transformer (2 dense + 2 MoE layers, a shared expert added) with adapters on every
target (attention, dense feed-forward, shared expert, per-expert routed adapters, router), every adapter
random (B too, so every gradient is non-zero). Each rank runs its own uneven microbatches of step 0
(one has no valid target); the gathered adapter gradients must equal the float64 single process's over
the whole global batch to 1e-5 relative, the base must hold no gradient, and after two AdamW
steps the frozen base weights (sharded by EP and FSDP alike) must be bitwise what they were.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from parity_support import MODEL_CFG, initial_state, load_full_state, make_batches, relative_error
from test_pipeline import SEQ, FixedLoader, full, job_config
from test_pipeline import make_batches as make_pp_batches

from moetrain.config.job import JobConfig
from moetrain.config.lora import LoraConfig
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.config.parallel import ParallelConfig
from moetrain.data.packing import IGNORE_INDEX
from moetrain.model.init import _local_view, is_adapter_name
from moetrain.model.lora import adapter_parameters, apply_lora
from moetrain.model.transformer import Transformer
from moetrain.testing import run_on_ranks
from moetrain.train.build import build_model
from moetrain.train.loss import microbatch_loss, token_loss_sum

BOUND = 1e-5
CFG = dataclasses.replace(MODEL_CFG, moe=dataclasses.replace(MODEL_CFG.moe, n_shared_experts=1))
LORA = LoraConfig(rank=2, alpha=3.0, targets=["attention", "ffn", "shared_experts", "experts", "router"])
SHARED = dataclasses.replace(LORA, expert_mode="shared")


def lora_state(lora: LoraConfig) -> dict[str, torch.Tensor]:
    """Base weights of the parity grid's init and random adapters, all float32."""
    model = Transformer(CFG)
    apply_lora(model, lora)
    gen = torch.Generator().manual_seed(7)
    state = {}
    base = initial_state() | {k: v for k, v in _shared_expert_init(model).items()}
    for name, tensor in model.state_dict().items():
        state[name] = (0.3 * torch.randn(tensor.shape, generator=gen) if ".lora_" in name else base[name]).float()
    return state


def _shared_expert_init(model: Transformer) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {name: torch.randn(t.shape, generator=gen) / t.shape[-1] ** 0.5
            for name, t in model.state_dict().items() if "shared_expert." in name and ".lora_" not in name}


def _n_valid(microbatches) -> int:
    return sum(int((t != IGNORE_INDEX).sum()) for _, t in microbatches)


def reference_grads(lora, state, batches) -> dict[str, torch.Tensor]:
    model = Transformer(CFG)
    apply_lora(model, lora)
    model.load_state_dict(state)
    model.double()
    everything = [mb for rank in batches[0] for mb in rank]
    global_tokens = _n_valid(everything)
    for tokens, targets in everything:
        loss_sum, n_valid = token_loss_sum(model(tokens), targets)
        microbatch_loss(loss_sum, n_valid, global_tokens, model.aux_loss()).backward()
    return {name: p.grad.detach().clone() for name, p in adapter_parameters(model).items()}


def worker(lora, state, batches):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from moetrain.parallel.grad_sync import count_global_tokens
    from moetrain.parallel.mesh import JobMesh

    rank, world = dist.get_rank(), dist.get_world_size()
    pcfg = ParallelConfig(dp_shard=4, ep=2)
    model = build_model(CFG, pcfg, JobMesh.from_config(pcfg, world, torch.device("cpu")), weights="none", lora=lora)
    load_full_state(model, state)

    def full(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().numpy().copy()

    microbatches = batches[0][rank]
    global_tokens = count_global_tokens(_n_valid(microbatches))
    for tokens, targets in microbatches:
        loss_sum, n_valid = token_loss_sum(model(tokens), targets)
        microbatch_loss(loss_sum, n_valid, global_tokens, model.aux_loss()).backward()
    adapters = adapter_parameters(model)
    grads = {name: full(p.grad) for name, p in adapters.items()}
    base_grads = [name for name, p in model.named_parameters() if name not in adapters and p.grad is not None]
    optimizer = torch.optim.AdamW(adapters.values(), lr=1e-2)
    for step in (1,):
        optimizer.step()
        optimizer.zero_grad()
        microbatches = batches[step][rank]
        global_tokens = count_global_tokens(_n_valid(microbatches))
        for tokens, targets in microbatches:
            loss_sum, n_valid = token_loss_sum(model(tokens), targets)
            microbatch_loss(loss_sum, n_valid, global_tokens, model.aux_loss()).backward()
    optimizer.step()
    base = {name: full(p) for name, p in model.named_parameters() if name not in adapters}
    moved = {name: full(p) for name, p in adapters.items()}
    return (grads, base_grads, base, moved) if rank == 0 else None


# per_expert: each rank's adapters are its experts' (split by EP like the experts); shared: one pair per layer,
# whole on every rank, whose gradient is the sum of what every EP rank's experts contributed.
@pytest.mark.parametrize("lora", [LORA, SHARED], ids=["per_expert", "shared"])
def test_adapter_gradients_under_fsdp2_ep2_equal_float64_and_the_base_stays_unchanged(lora):
    state = lora_state(lora)
    batches = make_batches(n_steps=2)
    grads, base_grads, base, moved = run_on_ranks(worker, 4, lora, state, batches, timeout=240)[0]
    want = reference_grads(lora, state, batches)
    assert set(grads) == set(want) and base_grads == []
    got = {name: torch.from_numpy(g).double() for name, g in grads.items()}
    error, where = relative_error(got, want)
    print(f"{lora.expert_mode}: {len(got)} adapter gradients, max relative error {error:.2e} at {where}")
    assert error < BOUND, (error, where)
    assert all(float(w.abs().max()) > 0 for w in want.values())  # every adapter takes a gradient
    for name, value in base.items():
        assert np.array_equal(value, state[name].numpy()), name
    assert any(not np.array_equal(value, state[name].numpy()) for name, value in moved.items())


# ---- pipeline parallelism: the Trainer's own step on 2 stages x 2 FSDP ranks, against one float64 process

PP_CFG = ModelConfig(vocab_size=259, dim=16, n_layers=4, n_heads=2, ffn_hidden=24, n_dense_layers=1,
                     max_seq_len=SEQ, moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=8, n_shared_experts=1,
                                                    aux_loss_coef=0.0, z_loss_coef=0.0))


def _pp_job(grad_accum: int, **parallel) -> JobConfig:
    cfg = job_config(PP_CFG, grad_accum, **parallel)
    cfg.lora = LoraConfig(rank=2, alpha=3.0, targets=["attention", "ffn", "shared_experts", "experts", "router"])
    return cfg.validate()


def _randomize_adapters(model) -> None:
    """Every adapter (B too) a seeded draw by name, each rank filling its own slice: non-zero gradients."""
    with torch.no_grad():
        for name, param in adapter_parameters(model).items():
            local, shape, offset = _local_view(param)
            whole = 0.3 * torch.randn(shape, generator=torch.Generator().manual_seed(len(name) * 31 + 7))
            for dim, (start, length) in enumerate(zip(offset, local.shape, strict=True)):
                whole = whole.narrow(dim, start, length)
            local.copy_(whole)


def pp_worker(cfg: JobConfig, batches, checkpoint_dir: str) -> dict:
    from moetrain.checkpoint.storage import save_checkpoint
    from moetrain.data.dataset import load_training_data
    from moetrain.parallel.mesh import JobMesh
    from moetrain.train.trainer import Trainer

    job = JobMesh.from_config(cfg.parallel, dist_world(), "cpu")
    trainer = Trainer(cfg, load_training_data(cfg), job)
    _randomize_adapters(trainer.model)
    trainer.loader = FixedLoader([step[job.data_rank] for step in batches])
    grads = {}
    step_optimizer = trainer.optimizer.step

    def recording_step(*args, **kwargs):
        grads.update({name: full(p.grad).numpy() for name, p in adapter_parameters(trainer.model).items()})
        grads["base with a gradient"] = [n for n, p in trainer.model.named_parameters() if p.grad is not None
                                         and not is_adapter_name(n)]
        return step_optimizer(*args, **kwargs)

    trainer.optimizer.step = recording_step
    trainer.train_step()
    save_checkpoint(checkpoint_dir, 1, trainer.model, trainer.optimizer, trainer.trainer_state(),
                    {}, keep_last=1)
    trained = {name: full(p).numpy() for name, p in adapter_parameters(trainer.model).items()}
    return {"grads": grads, "trained": trained}


def dist_world() -> int:
    import torch.distributed as dist

    return dist.get_world_size()


def pp_reference_grads(cfg: JobConfig, batches) -> dict[str, torch.Tensor]:
    model = build_model(cfg.model, weights="init", seed=cfg.train.seed, lora=cfg.lora)
    _randomize_adapters(model)
    model.double()
    everything = [mb for rank in batches[0] for mb in rank]
    global_tokens = sum(int((b.targets != IGNORE_INDEX).sum()) for b in everything)
    for b in everything:
        loss_sum, n_valid = token_loss_sum(model(b.tokens, b.positions, b.document_ids), b.targets)
        microbatch_loss(loss_sum, n_valid, global_tokens).backward()
    return {name: p.grad.detach().clone() for name, p in adapter_parameters(model).items()}


def test_adapter_gradients_under_pp2_equal_float64_and_the_checkpoint_gathers_the_stages(tmp_path):
    from moetrain.checkpoint.layout import latest_complete
    from moetrain.train.build import model_of_run

    cfg = _pp_job(2, pp=2)  # 2 stages x 2 FSDP ranks, 2 microbatches per data rank
    batches = make_pp_batches(2, 2, seed=5)
    per_rank = run_on_ranks(pp_worker, 4, cfg, batches, str(tmp_path), timeout=300)
    grads, trained, base_grads = {}, {}, []
    for result in per_rank:
        base_grads += result["grads"].pop("base with a gradient")
        grads.update({k: torch.from_numpy(v).double() for k, v in result["grads"].items()})
        trained.update(result["trained"])
    want = pp_reference_grads(cfg, batches)
    assert set(grads) == set(want) and base_grads == []  # every stage's adapters, no base gradient
    error, where = relative_error(grads, want)
    print(f"pp 2 x fsdp 2: {len(grads)} adapter gradients, max relative error {error:.2e} at {where}")
    assert error < BOUND, (error, where)
    # The checkpoint holds every stage's adapters: one process (what export-hf builds) reads them back whole.
    model = model_of_run(_pp_job(4), latest_complete(tmp_path))
    for name, param in adapter_parameters(model).items():
        assert np.array_equal(param.detach().numpy(), trained[name]), name


# ---- lora.init_from under pipeline parallelism: each stage reads its own layers' adapters

def pp_init_worker(cfg: JobConfig) -> dict:
    from moetrain.parallel.mesh import JobMesh
    from moetrain.train.build import build_pipeline

    pipeline = build_pipeline(cfg, JobMesh.from_config(cfg.parallel, dist_world(), "cpu"))
    return {name: full(p).numpy() for name, p in adapter_parameters(pipeline.model).items()}


def _exportable_pp_job(**parallel) -> JobConfig:
    """`_pp_job` shaped as Qwen3-MoE (per-head QK-norm, no shared expert): a PEFT directory names a family's modules."""
    qwen3_moe = dataclasses.replace(PP_CFG, qk_norm="per_head", moe=dataclasses.replace(PP_CFG.moe, n_shared_experts=0))
    cfg = job_config(qwen3_moe, 2, **parallel)
    cfg.lora = LoraConfig(rank=2, alpha=3.0, targets=["attention", "ffn", "experts", "router"])
    return cfg.validate()


def test_a_pipeline_started_from_a_peft_directory_holds_one_process_adapters(tmp_path):
    from moetrain.interop.peft_adapter import save_peft_adapter

    cfg = _exportable_pp_job()
    model = build_model(cfg.model, weights="init", seed=cfg.train.seed, lora=cfg.lora)
    _randomize_adapters(model)  # not PEFT's start (B zero): every value read must come from the directory
    directory = save_peft_adapter(model, cfg, tmp_path / "adapter")
    pp_cfg = _exportable_pp_job(pp=2)  # 2 stages x 2 FSDP ranks
    pp_cfg.lora.init_from = str(directory)
    read: dict = {}
    for stage in run_on_ranks(pp_init_worker, 4, pp_cfg.validate(), timeout=300):
        read.update(stage)
    want = adapter_parameters(model)
    assert set(read) == set(want)  # the stages together hold every adapter
    for name, param in want.items():
        assert np.array_equal(read[name], param.detach().double().numpy()), name
