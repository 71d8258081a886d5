"""DeepSeek-V3 on 4 gloo ranks (HSDP 2×2, and expert parallelism over 2 ranks of a 1×4 mesh), against one process.

The same checks as test_families.py, for multi-head latent attention, group-limited sigmoid routing
with the correction bias, a shared expert and a dense first layer (one spawn of 4 ranks):
- a global-batch balance step with EP = 2 (and under HSDP 2×2): loss terms and every gradient equal a
  float64 single-process step on the whole batch;
- sharded import of a DeepSeek-V3 directory: weights (the correction bias included) equal a
  one-process import and logits equal transformers';
- sharded export of the imported model: bit for bit the original directory's tensors, loadable by
  `from_pretrained` without missing or unexpected keys;
- the same import and export of a GLM-4.5 directory (full rotary, so kept in the interleaved layout:
  q/k rows and their biases permuted across shards) under HSDP 2×2.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
import torch.distributed as dist
from test_families import balance_batch, balance_step, family_worker, job, read_dir, to_torch

import hf_tiny
from moetrain.config.job import JobConfig
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.data.corpus import stdlib_root
from moetrain.interop import hf_job_config, load_hf_weights
from moetrain.model.transformer import Transformer
from moetrain.testing import run_on_ranks

BALANCE_CFG = ModelConfig(
    vocab_size=19, dim=16, n_layers=3, n_heads=2, n_dense_layers=1, ffn_hidden=12, max_seq_len=16,
    kv_lora_rank=8, q_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=6,
    moe=MoEConfig(n_experts=8, top_k=2, expert_hidden=6, n_shared_experts=1, score_func="sigmoid", n_group=4,
                  topk_group=2, routed_scaling_factor=2.5, impl="memory_efficient", aux_loss_coef=0.3,
                  z_loss_coef=0.02, aux_loss_scope="global_batch"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deepseek")
    corpus = tmp / "corpus"
    corpus.mkdir()
    for name in ("bisect.py", "colorsys.py", "keyword.py"):
        shutil.copyfile(stdlib_root() / name, corpus / name)
    hf_model = hf_tiny.build("deepseek_v3", seed=12)
    directory = hf_tiny.save(hf_model, tmp / "deepseek_v3")
    glm_model = hf_tiny.build("glm4_moe", seed=13, rope_parameters={"rope_type": "default", "rope_theta": 1000.0,
                                                                    "partial_rotary_factor": 1.0})
    glm_directory = hf_tiny.save(glm_model, tmp / "glm4_moe")
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    hsdp, ep = JobConfig(model=BALANCE_CFG), JobConfig(model=BALANCE_CFG)
    hsdp.parallel.dp_replicate, ep.parallel.ep = 2, 2
    jobs = [job(directory, tmp, corpus, "hsdp", replicate=2), job(directory, tmp, corpus, "ep", ep=2),
            job(glm_directory, tmp, corpus, "glm_hsdp", replicate=2)]
    four = to_torch(run_on_ranks(family_worker, 4, jobs, [hsdp, ep], tokens, timeout=600)[0])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        one = to_torch(family_worker([job(directory, tmp, corpus, "one"), job(glm_directory, tmp, corpus, "glm_one")],
                                     [], tokens))
    finally:
        dist.destroy_process_group()
    return hf_model, directory, tokens, four, one, tmp, (glm_model, glm_directory)


@pytest.mark.parametrize("layout", [0, 1], ids=["hsdp_2x2", "ep_2_on_1x4"])
def test_mla_group_routing_step_on_4_ranks_equals_float64_one_process(runs, layout):
    four = runs[3]
    reference = Transformer(BALANCE_CFG).double()
    reference.init_weights(seed=0)
    want_parts, want_grads = balance_step(reference, [balance_batch()])
    got_parts, got_grads = four["balance"][layout]
    torch.testing.assert_close(got_parts, want_parts, rtol=1e-6, atol=0)
    assert want_parts[1] > 0 and want_parts[2] > 0
    for name, want in want_grads.items():
        error = float((got_grads[name] - want).abs().max() / want.abs().max())
        assert error < 1e-5, (name, error)


@pytest.mark.parametrize("layout", ["hsdp", "ep"])
def test_sharded_deepseek_import_equals_one_process_and_transformers(runs, layout):
    hf_model, directory, tokens, four, _, _, _ = runs
    reference = Transformer(hf_job_config(directory).model)
    load_hf_weights(reference, directory)
    for name, param in reference.named_parameters():
        assert torch.equal(four[layout]["weights"][name], param.detach()), name
    with torch.no_grad():
        assert hf_tiny.relative_error(four[layout]["logits"], hf_model(tokens).logits) < 1e-5


def test_deepseek_exports_from_4_rank_checkpoints_equal_the_original(runs):
    from transformers import AutoModelForCausalLM

    _, directory, tokens, _, one, tmp, _ = runs
    original = read_dir(directory)
    assert "model.layers.2.mlp.gate.e_score_correction_bias" in original
    for name in ("hsdp", "ep", "one"):
        tensors = read_dir(tmp / name / "hf")
        assert set(tensors) == set(original), name
        for key, tensor in original.items():
            assert torch.equal(tensors[key], tensor), (name, key)
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp / "ep" / "hf", output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"]) == (set(), set())
    with torch.no_grad():
        assert hf_tiny.relative_error(loaded(tokens).logits, one["one"]["logits"]) < 1e-5


def test_sharded_glm_import_and_export_equal_one_process_transformers_and_the_original(runs):
    _, _, tokens, four, one, tmp, (glm_model, glm_directory) = runs
    reference = Transformer(dataclasses.replace(hf_job_config(glm_directory).model, rope_layout="interleaved"))
    load_hf_weights(reference, glm_directory)
    for name, param in reference.named_parameters():
        assert torch.equal(four["glm_hsdp"]["weights"][name], param.detach()), name
    with torch.no_grad():
        assert hf_tiny.relative_error(four["glm_hsdp"]["logits"], glm_model(tokens).logits) < 1e-5
    original = read_dir(glm_directory)
    assert "model.layers.0.self_attn.q_proj.bias" in original
    for name in ("glm_hsdp", "glm_one"):
        tensors = read_dir(tmp / name / "hf")
        assert set(tensors) == set(original), name
        for key, tensor in original.items():
            assert torch.equal(tensors[key], tensor), (name, key)
