"""Pipeline parallelism composed with FSDP, HSDP and expert parallelism equals one process on the global batch.

Each run is the Trainer's own step on gloo ranks, fed the same hand-made global batch that one process
trains on whole: microbatches with uneven valid-target counts and documents, one without any valid
target. Compared per step: the loss, balance and z-loss, the gradient norm, every parameter's full
gradient (read just before the optimizer steps) and, for the aux-loss-free model, the expert bias.
The one-process reference shares no pipeline code (it is the plain accumulation loop).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import hf_tiny
from moetrain.config.job import JobConfig
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.data.dataset import load_training_data
from moetrain.data.packing import IGNORE_INDEX, Batch
from moetrain.interop import hf_job_config
from moetrain.parallel.mesh import JobMesh
from moetrain.parallel.shard import fsdp_modules
from moetrain.testing.multirank import run_on_ranks
from moetrain.train import run
from moetrain.train.build import build_model, build_pipeline
from moetrain.train.trainer import Trainer
from stdlib_corpus import copy_stdlib_modules

SEQ, MICRO, STEPS = 8, 2, 2

TINY_MOE = ModelConfig(vocab_size=259, dim=16, n_layers=4, n_heads=2, ffn_hidden=24, n_dense_layers=1,
                       max_seq_len=SEQ, moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=8, aux_loss_coef=0.05,
                                                      z_loss_coef=0.01))
# DeepSeek-V3's shape: MLA with a query latent, a dense first layer, sigmoid group-limited top-k with
# a shared expert, aux-loss-free balancing (bias update) plus the global-batch balance loss.
DEEPSEEK = ModelConfig(vocab_size=259, dim=16, n_layers=8, n_heads=2, ffn_hidden=24, n_dense_layers=1,
                       max_seq_len=SEQ, kv_lora_rank=8, q_lora_rank=12, qk_nope_head_dim=4, qk_rope_head_dim=4,
                       v_head_dim=4, rope_layout="interleaved",
                       moe=MoEConfig(n_experts=8, top_k=2, expert_hidden=8, n_shared_experts=1, score_func="sigmoid",
                                     n_group=4, topk_group=2, routed_scaling_factor=2.5, load_balance="aux_free",
                                     bias_update_rate=0.01))
# The same shape with the global-batch balance loss (the step's expert counts from a routing pass) and z-loss.
DEEPSEEK_GLOBAL = dataclasses.replace(DEEPSEEK, moe=dataclasses.replace(
    DEEPSEEK.moe, load_balance="aux_loss", aux_loss_scope="global_batch", aux_loss_coef=0.05, z_loss_coef=0.01))
MODELS = {"tiny_moe": TINY_MOE, "deepseek_v3": DEEPSEEK, "deepseek_v3_global": DEEPSEEK_GLOBAL}


def make_batches(world_data: int, micro: int, seed: int) -> list[list[list[Batch]]]:
    """[step][data rank][microbatch] batches of fixed shape [MICRO, SEQ]: documents of random lengths,
    uneven masking; step 0's second microbatch on data rank 0 has no valid target."""
    gen = torch.Generator().manual_seed(seed)
    steps = []
    for step in range(STEPS):
        ranks = []
        for rank in range(world_data):
            batches = []
            for m in range(micro):
                tokens = torch.randint(0, 256, (MICRO, SEQ), generator=gen)
                targets = torch.randint(0, 256, (MICRO, SEQ), generator=gen)
                targets[torch.rand(MICRO, SEQ, generator=gen) < 0.2 + 0.15 * ((rank + m) % 4)] = IGNORE_INDEX
                if (step, rank, m) == (0, 0, 1):
                    targets.fill_(IGNORE_INDEX)
                documents = torch.cumsum(torch.rand(MICRO, SEQ, generator=gen) < 0.25, dim=1)
                positions = torch.cat([torch.arange(SEQ)[None] - torch.nonzero(
                    torch.diff(row, prepend=row[:1] - 1)).flatten().repeat_interleave(
                    torch.diff(torch.nonzero(torch.diff(row, prepend=row[:1] - 1)).flatten(),
                               append=torch.tensor([SEQ])))[None] for row in documents])
                batches.append(Batch(tokens, positions, documents, targets))
            ranks.append(batches)
        steps.append(ranks)
    return steps


class FixedLoader:
    """Stands in for the data loader: the given microbatches of this data rank, step after step."""

    def __init__(self, steps: list[list[Batch]]):
        self.steps = iter(steps)

    def next_microbatches(self) -> list[Batch]:
        return next(self.steps)


def job_config(model: ModelConfig, micro: int, **parallel) -> JobConfig:
    cfg = JobConfig(model=model)
    for key, value in parallel.items():
        setattr(cfg.parallel, key, value)
    cfg.data.seq_len, cfg.data.max_documents, cfg.data.heldout_fraction = SEQ, 8, 0.0
    cfg.train.microbatch_size, cfg.train.grad_accum, cfg.train.steps = MICRO, micro, STEPS
    cfg.train.warmup_steps, cfg.train.lr, cfg.train.grad_clip = 0, 1e-2, 0.0
    cfg.logging.progress_bar = False
    return cfg.validate()


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().double().clone()


def train_worker(cfg: JobConfig, batches: list[list[list[Batch]]]) -> dict:
    """The trainer's steps on this rank's data coordinate; per step: sums, norm, full gradients, the number of
    replicate all-reduces the schedule issued and the FSDP parameter groups it holds; the final expert bias."""
    world = dist.get_world_size()
    job = JobMesh.from_config(cfg.parallel, world, "cpu")
    trainer = Trainer(cfg, load_training_data(cfg), job)
    if job.data_world == 1 and len(batches[0]) > 1:  # one process trains every data rank's microbatches
        trainer.loader = FixedLoader([[b for rank in step for b in rank] for step in batches])
    else:
        trainer.loader = FixedLoader([step[job.data_rank] for step in batches])
    grads: list[dict] = []
    step_optimizer = trainer.optimizer.step

    def recording_step(*args, **kwargs):
        grads.append({name: full(p.grad) for name, p in trainer.model.named_parameters() if p.grad is not None})
        return step_optimizer(*args, **kwargs)

    trainer.optimizer.step = recording_step
    replicate = job.data.get_group("dp_replicate") if job.dims.dp_replicate > 1 else None
    counted = []
    if trainer.pipeline is not None:  # count the schedule's all-reduces over the replicate group
        schedule_step, all_reduce = trainer.pipeline.schedule.step, dist.all_reduce

        def counting_all_reduce(tensor, *args, group=None, **kwargs):
            counted[-1] += group is not None and group == replicate
            return all_reduce(tensor, *args, group=group, **kwargs)

        def counting_step(*args, **kwargs):
            counted.append(0)
            dist.all_reduce = counting_all_reduce
            try:
                return schedule_step(*args, **kwargs)
            finally:
                dist.all_reduce = all_reduce

        trainer.pipeline.schedule.step = counting_step
    results = []
    for _ in range(STEPS):
        result = trainer.train_step()
        results.append({"loss": result.loss, "aux": result.aux_loss, "z": result.z_loss, "norm": result.grad_norm})
    groups = sum(len(unit._get_fsdp_state()._fsdp_param_groups) for unit in fsdp_modules(trainer.model)
                 if unit._get_fsdp_state()._fsdp_param_groups) + sum(
        len(part._get_fsdp_state()._fsdp_param_groups) for part in
        (trainer.pipeline.pipeline.parts if trainer.pipeline is not None else []))
    bias = {f"layers.{layer.layer_id}": layer.moe.expert_bias.clone() for layer in trainer.model.layers if layer.is_moe}
    return {"steps": results, "grads": [{k: v.numpy() for k, v in g.items()} for g in grads],
            "bias": {k: v.numpy() for k, v in bias.items()}, "replicate_all_reduces": counted, "param_groups": groups}


def layouts_worker(runs: list[tuple[JobConfig, list]]) -> list[dict]:
    return [train_worker(cfg, batches) for cfg, batches in runs]


def merged(per_rank: list[dict]) -> dict:
    """The ranks' results as one: gradients and biases by name (every stage contributes its own)."""
    out = {"steps": per_rank[0]["steps"], "grads": [{} for _ in per_rank[0]["grads"]], "bias": {}}
    for result in per_rank:
        for step, grads in enumerate(result["grads"]):
            out["grads"][step].update({k: torch.from_numpy(v) for k, v in grads.items()})
        out["bias"].update({k: torch.from_numpy(v) for k, v in result["bias"].items()})
    return out


def relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / max(float(expected.norm()), 1e-12))


# name -> (ranks, model, microbatches per data rank, parallel fields)
LAYOUTS = {
    "pp2_fsdp2": (4, "tiny_moe", 2, {"pp": 2}),
    "pp2_ep2": (4, "deepseek_v3_global", 2, {"pp": 2, "ep": 2}),
    "pp4_interleaved": (4, "deepseek_v3", 4, {"pp": 4, "pp_schedule": "Interleaved1F1B", "pp_stages_per_rank": 2}),
    "pp2_zbv_ep2": (4, "tiny_moe", 4, {"pp": 2, "pp_schedule": "ZBVZeroBubble", "pp_stages_per_rank": 2, "ep": 2}),
    "pp2_hsdp2x2": (8, "deepseek_v3", 2, {"pp": 2, "dp_replicate": 2}),
}


def _run(name: str) -> tuple[dict, dict, list[dict]]:
    ranks, model_name, micro, parallel = LAYOUTS[name]
    data_world = ranks // parallel["pp"]
    return (job_config(MODELS[model_name], micro, **parallel),
            job_config(MODELS[model_name], micro * data_world), make_batches(data_world, micro, seed=len(name)))


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[list[dict], dict]]:
    """layout -> (per-rank results, the one-process reference); each rank count forked once for all its layouts."""
    jobs = {name: _run(name) for name in LAYOUTS}
    per_rank: dict[str, list[dict]] = {}
    for ranks in sorted({r for r, *_ in LAYOUTS.values()}):
        names = [name for name in LAYOUTS if LAYOUTS[name][0] == ranks]
        results = run_on_ranks(layouts_worker, ranks, [(jobs[n][0], jobs[n][2]) for n in names], timeout=600)
        for i, name in enumerate(names):
            per_rank[name] = [rank_results[i] for rank_results in results]
    references = run_on_ranks(layouts_worker, 1, [(jobs[n][1], jobs[n][2]) for n in LAYOUTS], timeout=600)[0]
    return {name: (per_rank[name], merged([references[i]])) for i, name in enumerate(LAYOUTS)}


@pytest.mark.parametrize("name", LAYOUTS)
def test_pipeline_step_equals_one_process_on_the_global_batch(runs, name):
    per_rank, want = runs[name]
    got = merged(per_rank)
    for step, (g, w) in enumerate(zip(got["steps"], want["steps"], strict=True)):
        for key in ("loss", "aux", "z", "norm"):
            assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-9), (step, key)
    for step, (g, w) in enumerate(zip(got["grads"], want["grads"], strict=True)):
        assert g.keys() == w.keys()
        worst = max((relative(g[k], w[k]), k) for k in w)
        assert worst[0] < 1e-5, (step, worst)
    assert got["bias"].keys() == want["bias"].keys()
    for key in want["bias"]:
        torch.testing.assert_close(got["bias"][key], want["bias"][key], rtol=0, atol=1e-7)


def test_hsdp_under_a_pipeline_all_reduces_each_parameter_group_once_per_step(runs):
    """2 microbatches per step, yet each FSDP parameter group is all-reduced over the replicate ranks once."""
    for result in runs["pp2_hsdp2x2"][0]:
        assert result["param_groups"] > 0
        assert result["replicate_all_reduces"] == [result["param_groups"]] * STEPS


def _cli_args(run_dir, corpus, steps: int, grad_accum: int, resume: bool = False, **parallel) -> list[str]:
    fields = {
        "model.dim": 16, "model.n_layers": 4, "model.n_heads": 2, "model.ffn_hidden": 24, "model.n_dense_layers": 1,
        "model.max_seq_len": 16, "model.moe.n_experts": 4, "model.moe.top_k": 2, "model.moe.expert_hidden": 8,
        "model.moe.z_loss_coef": 0.01, "data.source": "dir", "data.path": corpus, "data.glob": "*.py",
        "data.seq_len": 16, "data.heldout_fraction": 0.2, "train.steps": steps, "train.microbatch_size": 2,
        "train.grad_accum": grad_accum, "train.warmup_steps": 0, "train.eval_every": 0, "train.eval_batches": 2,
        "train.sample_tokens": 0, "checkpoint.every": 2, "checkpoint.resume": resume, "logging.run_dir": run_dir,
        "logging.log_every": 1, "logging.progress_bar": False,
        **{f"parallel.{key}": value for key, value in parallel.items()},
    }
    return [arg for key, value in fields.items() for arg in (f"--{key}", str(value))]


def _records(run_dir) -> dict:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"train": {r["step"]: r for r in lines if r["kind"] == "train"}, "final": lines[-1]}


def _resume_from(source, target) -> None:
    (target / "checkpoints").mkdir(parents=True)
    shutil.copytree(source / "checkpoints" / "step_00000002", target / "checkpoints" / "step_00000002")


def resume_worker(tmp, corpus, hf_dir) -> dict:
    """A DeepSeek-V3 directory imported under PP 2 x FSDP 2 (this rank's full weights by name); then
    `moetrain train` under PP 2 x FSDP 2 for 3 steps (saving step 2), and step 2's checkpoint resumed
    under EP 4 and under PP 4 for step 3 (the same global batch: data ranks x grad_accum = 4 microbatches)."""
    tmp = Path(tmp)
    cfg = hf_job_config(hf_dir)
    cfg.parallel.pp, cfg.train.grad_accum = 2, 2
    cfg.validate()
    pipeline = build_pipeline(cfg, JobMesh.from_config(cfg.parallel, dist.get_world_size(), "cpu"),
                              weights=f"hf:{hf_dir}")
    imported = {name: full(p).numpy() for name, p in pipeline.model.named_parameters()}
    assert run.main(_cli_args(tmp / "pp2", corpus, 3, 2, pp=2)) == 0
    if dist.get_rank() == 0:
        for name in ("ep4", "pp4", "one"):
            _resume_from(tmp / "pp2", tmp / name)
    dist.barrier()
    assert run.main(_cli_args(tmp / "ep4", corpus, 3, 1, resume=True, ep=4)) == 0
    assert run.main(_cli_args(tmp / "pp4", corpus, 3, 4, resume=True, pp=4)) == 0
    return imported


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """(tmp dir, each rank's imported weights, the HF directory)."""
    tmp = tmp_path_factory.mktemp("pp_cli")
    corpus = copy_stdlib_modules(tmp / "corpus", ("bisect.py", "colorsys.py", "keyword.py", "this.py", "stat.py",
                                                   "glob.py"))
    hf_dir = hf_tiny.save(hf_tiny.build("deepseek_v3"), tmp / "deepseek_v3")
    imported = run_on_ranks(resume_worker, 4, str(tmp), str(corpus), str(hf_dir), timeout=600)
    run_on_ranks(run.main, 1, _cli_args(tmp / "one", corpus, 3, 4, resume=True), timeout=600)
    return tmp, imported, hf_dir


def test_hugging_face_import_under_a_pipeline_equals_one_process(cli_runs):
    _, imported, hf_dir = cli_runs
    want = build_model(hf_job_config(hf_dir).model, weights=f"hf:{hf_dir}").state_dict()
    got = {name: value for rank in imported for name, value in rank.items()}
    assert got.keys() == {name for name, _ in build_model(hf_job_config(hf_dir).model).named_parameters()}
    for name, value in got.items():
        torch.testing.assert_close(torch.from_numpy(value), want[name].double(), rtol=0, atol=0)


def test_a_pipeline_checkpoint_resumes_exactly_under_ep_another_pipeline_and_one_process(cli_runs):
    tmp_path = cli_runs[0]
    expected = _records(tmp_path / "pp2")
    assert sorted(expected["train"]) == [1, 2, 3]
    for name in ("ep4", "pp4", "one"):
        got = _records(tmp_path / name)
        assert sorted(got["train"]) == [3], name
        assert got["train"][3]["valid_tokens"] == expected["train"][3]["valid_tokens"], name
        for key in ("loss", "grad_norm", "aux_loss"):
            assert got["train"][3][key] == pytest.approx(expected["train"][3][key], rel=1e-5), (name, key)
        assert got["final"]["heldout_loss"] == pytest.approx(expected["final"]["heldout_loss"], rel=1e-5), name
