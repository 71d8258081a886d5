"""The memory estimate against what a model really allocates, and the refusal before anything is allocated."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moetrain.config.job import parse_job_args
from moetrain.errors import ConfigError
from moetrain.model import gemm_attention
from moetrain.model.attention import document_causal_mask
from moetrain.model.memory_estimate import estimate_training_memory
from moetrain.model.transformer import Transformer
from moetrain.runtime import preflight
from moetrain.train.loss import token_loss_sum

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny_moe.toml")
SMALL = ["--config", TINY, "--data.seq_len", "64", "--train.microbatch_size", "2", "--model.n_layers", "3"]


def saved_for_backward_bytes(cfg) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in one forward + loss."""
    torch.manual_seed(0)
    model = Transformer(cfg.model)
    model.init_weights(seed=0)
    batch, seq = cfg.train.microbatch_size, cfg.data.seq_len
    tokens = torch.randint(0, cfg.model.vocab_size, (batch, seq))
    documents = (torch.arange(seq) >= seq // 3).long().expand(batch, seq)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_loss_sum(model(tokens, document_ids=documents), tokens)
    return sum(saved.values())


@pytest.mark.parametrize("extra", [[], ["--model.moe.impl", "grouped"], ["--model.n_dense_layers", "3"],
                                   ["--model.moe.top_k", "4", "--model.n_kv_heads", "2"]])
def test_activation_estimate_is_a_close_lower_bound_of_what_autograd_saves(extra):
    cfg = parse_job_args([*SMALL, *extra])
    measured = saved_for_backward_bytes(cfg)
    estimated = estimate_training_memory(cfg).activations
    assert 0.5 * measured <= estimated <= measured, (estimated, measured)


def test_mask_and_parameter_terms_are_exact():
    cfg = parse_job_args(SMALL)
    documents = torch.zeros(cfg.train.microbatch_size, cfg.data.seq_len, dtype=torch.long)
    mask = document_causal_mask(documents)
    estimate = estimate_training_memory(cfg, dp_shard=2)
    assert estimate.attention_mask == mask.numel() * mask.element_size()
    with torch.device("meta"):
        n_params = sum(p.numel() for p in Transformer(cfg.model).parameters())
    assert estimate.parameters == 16 * n_params // 2  # fp32 weight + grad + two AdamW moments, sharded
    assert estimate.total == estimate.parameters + estimate.activations + estimate.attention_mask


def test_refusal_depends_on_the_memory_and_the_ranks_sharing_it(monkeypatch):
    cfg = parse_job_args(SMALL)
    need = estimate_training_memory(cfg).total
    monkeypatch.setattr(preflight, "physical_memory_bytes", lambda: need)
    assert preflight.refuse_if_too_big(cfg).total == need  # exactly fits
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"shared by 2 ranks") as err:
        preflight.refuse_if_too_big(parse_job_args([*SMALL, "--parallel.dp_replicate", "2"]))
    assert "\n" not in str(err.value)


def test_on_cuda_each_rank_is_compared_with_one_device(monkeypatch):
    need = estimate_training_memory(parse_job_args([*SMALL, "--train.microbatch_size", "4096"])).total

    class Properties:
        total_memory = need - 1

    asked = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: asked.append(index) or Properties())
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "5")
    # HSDP 16 x 1: every rank holds the whole model, as in the 1-rank estimate.
    hsdp = parse_job_args([*SMALL, "--parallel.device", "cuda", "--train.microbatch_size", "4096",
                           "--parallel.dp_replicate", "16"])
    with pytest.raises(ConfigError, match=r"of this CUDA device \(train.microbatch_size = 4096") as err:
        preflight.refuse_if_too_big(hsdp)
    assert asked == [5] and "shared by" not in str(err.value)
    Properties.total_memory = need
    assert preflight.refuse_if_too_big(hsdp).total == need


def test_token_budget_microbatch_is_one_row_of_the_budget(monkeypatch):
    # seq_len 64 × 2 rows would under-count a one-row microbatch of 512 tokens. With the CPU GEMM attention
    # off (size bound 0) every term is linear in the tokens; its saved probabilities grow with the row.
    monkeypatch.setattr(gemm_attention, "GEMM_ATTENTION_MAX_SCORES", 0)
    cfg = parse_job_args(SMALL + ["--data.batching", "token_budget", "--data.token_budget", "512"])
    mask = document_causal_mask(torch.zeros(1, 512, dtype=torch.long))
    estimate = estimate_training_memory(cfg)
    assert estimate.attention_mask == mask.numel() * mask.element_size()
    packed = estimate_training_memory(parse_job_args(SMALL))
    assert estimate.activations == packed.activations * 512 // (2 * 64)
