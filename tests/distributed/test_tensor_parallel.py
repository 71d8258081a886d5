"""Tensor parallelism with sequence parallelism on 4 gloo ranks against one float64 process; its refusals.

One 4-rank run (module fixture) trains every case of `CASES` for 2 SGD steps of 2 packed microbatches per
data-parallel rank, the way the trainer does (`SequenceSplit`: the vocabulary-parallel loss, token counts
once per TP group, the global-batch balance loss and the z-loss on the sequence-split tokens): TP 2 x FSDP 2
and TP 2 x EP 2 on a tiny MoE with grouped-query attention, a shared expert and a vocabulary TP splits
unevenly, and TP 2 x FSDP 2 on a GPT-OSS-shaped (sinks, a sliding window, biases), a GLM-4.5-shaped
(partial RoPE, per-head QK-norm, qkv biases) and a DeepSeek-V3-shaped (MLA) model. Losses of every step,
step-0 gradients and the final parameters are checked within 1e-5 of the largest reference entry.
The refusals run in this process: one line naming the field, exit code 2 through the CLI.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from split_parity_support import check_case, run_cases

import hf_tiny
from moetrain.cli import main as cli_main
from moetrain.config.job import JobConfig
from moetrain.errors import ConfigError
from moetrain.testing import run_on_ranks
from moetrain.train.build import load_hf_model

CASES = {
    "tiny_moe-tp2-fsdp2": ("tiny_moe", {"tp": 2}),
    "tiny_moe-tp2-ep2": ("tiny_moe", {"tp": 2, "ep": 2}),
    "gpt_oss_like-tp2-fsdp2": ("gpt_oss_like", {"tp": 2}),
    "glm_like-tp2-fsdp2": ("glm_like", {"tp": 2}),
    "deepseek_like-tp2-fsdp2": ("deepseek_like", {"tp": 2}),
}


@pytest.fixture(scope="module")
def results():
    return run_cases(CASES)


@pytest.mark.parametrize("case", list(CASES))
def test_tensor_parallel_trains_like_one_process(results, case):
    check_case(*results[case])


def _job(parallel: dict, model: dict | None = None, moe: dict | None = None, **sections) -> JobConfig:
    base = dataclasses.replace(JobConfig(), train=dataclasses.replace(JobConfig().train, sample_tokens=0))
    model_cfg = dataclasses.replace(base.model, n_heads=4, n_kv_heads=2, max_seq_len=64, **(model or {}))
    model_cfg = dataclasses.replace(model_cfg, moe=dataclasses.replace(
        model_cfg.moe, **({"aux_loss_scope": "global_batch"} | (moe or {}))))
    fields = {"model": model_cfg, "parallel": dataclasses.replace(base.parallel, **parallel),
              "data": dataclasses.replace(base.data, seq_len=64)}
    for name, changes in sections.items():
        fields[name] = dataclasses.replace(fields.get(name, getattr(base, name)), **changes)
    return dataclasses.replace(base, **fields)


# (parallel fields, model fields, moe fields, other sections, the start of the one-line error)
REFUSALS = [
    ({"tp": 3}, {}, {}, {}, "parallel.tp = 3 is invalid: must divide model.n_heads = 4"),
    ({"tp": 4}, {}, {}, {}, "parallel.tp = 4 is invalid: must divide the KV heads"),
    ({"cp": 3}, {}, {}, {}, "data.seq_len = 64 is invalid: must be divisible by 2 x parallel.cp x parallel.tp = 6"),
    ({"tp": 2}, {"qk_norm": "full"}, {}, {}, "model.qk_norm = 'full' is invalid: with parallel.tp > 1"),
    ({"tp": 2}, {"tie_embeddings": True}, {}, {}, "model.tie_embeddings = True is invalid: with parallel.tp > 1"),
    ({"cp": 2}, {}, {"aux_loss_scope": "microbatch"}, {}, "model.moe.aux_loss_scope = 'microbatch' is invalid"),
    ({"cp": 2}, {}, {}, {"data": {"batching": "token_budget"}}, "data.batching = 'token_budget' is invalid"),
    ({"tp": 2}, {}, {}, {"train": {"compile": True}}, "train.compile = True is invalid: with parallel.tp > 1"),
    ({"tp": 2}, {}, {}, {"train": {"sample_tokens": 8}}, "train.sample_tokens = 8 is invalid: with parallel.tp > 1"),
]


@pytest.mark.parametrize("parallel,model,moe,sections,message", REFUSALS)
def test_what_tensor_and_context_parallelism_cannot_run_is_refused_in_one_line(parallel, model, moe, sections,
                                                                              message):
    with pytest.raises(ConfigError) as err:
        _job(parallel, model, moe, **sections).validate()
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_job_within_those_limits_passes():
    _job({"tp": 2, "cp": 2}).validate()


def test_cli_refuses_heads_tp_does_not_divide_with_exit_code_2(capsys):
    assert cli_main(["train", "--config", "configs/tiny_moe.toml", "--parallel.tp", "3", "--dry-run"]) == 2
    assert "parallel.tp = 3 is invalid: must divide model.n_heads = 4" in capsys.readouterr().err


# ---- Hugging Face import and export on TP and CP meshes -------------------------------------------

# variant -> mesh: MLA (the riskier split) under TP, grouped-query attention with QK-norm under CP.
HF_CASES = {"deepseek_v3": ("tp2", {"tp": 2}), "qwen3_moe": ("cp2", {"cp": 2})}


def _hf_worker(model_dirs: dict[str, str], out_root: str) -> dict | None:
    """On each rank: every variant read from its directory on its mesh, then written back out."""
    import torch.distributed as dist

    from moetrain.config.parallel import ParallelConfig
    from moetrain.interop import hf_job_config, save_hf
    from moetrain.parallel.mesh import JobMesh
    from moetrain.parallel.process_group import init_distributed
    from moetrain.train.build import build_model

    rank, world, device = init_distributed(ParallelConfig())
    loaded = {}
    for variant, model_dir in model_dirs.items():
        cfg = hf_job_config(model_dir)
        mesh_name, fields = HF_CASES[variant]
        pcfg = ParallelConfig(**fields)
        model = build_model(cfg.model, pcfg, JobMesh.from_config(pcfg, world, device), device,
                            weights=f"hf:{model_dir}")
        loaded[variant] = {n: p.full_tensor().detach().numpy() for n, p in model.named_parameters()}
        save_hf(model, cfg, f"{out_root}/{variant}-{mesh_name}")
    dist.barrier()
    return loaded if rank == 0 else None


def test_hugging_face_import_and_export_are_exact_under_tp_and_cp(tmp_path):
    model_dirs = {variant: str(hf_tiny.save(hf_tiny.build_variant(variant), tmp_path / variant))
                  for variant in HF_CASES}
    loaded = run_on_ranks(_hf_worker, 4, model_dirs, str(tmp_path / "out"), timeout=600)[0]
    for variant, model_dir in model_dirs.items():
        reference = {n: p.detach() for n, p in load_hf_model(model_dir)[0].named_parameters()}
        mesh_name = HF_CASES[variant][0]
        exported = dict(load_hf_model(tmp_path / "out" / f"{variant}-{mesh_name}")[0].named_parameters())
        for name, expected in reference.items():
            assert torch.equal(torch.as_tensor(loaded[variant][name]), expected), (variant, mesh_name, name)
            assert torch.equal(exported[name].detach(), expected), (variant, mesh_name, name, "export")
