"""`moetrain estimate` under `train.optimizer = "muon"`: the optimizer state it counts is the state torch's
optimizer really holds after a step (one momentum buffer per Muon matrix, AdamW's two moments elsewhere),
and the report names the optimizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moetrain import cli
from moetrain.config.job import parse_job_args
from moetrain.model.memory_estimate import training_memory_breakdown
from moetrain.model.transformer import Transformer
from moetrain.train.optim import build_optimizer

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny_moe.toml")
SMALL = ["--config", TINY, "--data.seq_len", "64", "--train.microbatch_size", "2", "--model.n_layers", "3",
         "--model.vocab_size", "300"]
MLA_SHARED = ["--model.kv_lora_rank", "16", "--model.q_lora_rank", "24", "--model.qk_nope_head_dim", "8",
              "--model.qk_rope_head_dim", "8", "--model.v_head_dim", "8", "--model.moe.n_shared_experts", "1",
              "--model.moe.shared_expert_gate", "True", "--model.n_dense_layers", "1"]


def _held_state_bytes(cfg) -> int:
    """Bytes of the optimizer's tensors (the step counters aside) after one step of the real optimizer."""
    model = Transformer(cfg.model)
    optimizer = build_optimizer(model, cfg.train)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    optimizer.step()
    return sum(t.numel() * t.element_size() for state in optimizer.state.values() for key, t in state.items()
               if key != "step")


@pytest.mark.parametrize("extra", [
    [],
    ["--train.optimizer", "muon"],
    ["--train.optimizer", "muon", *MLA_SHARED],
    ["--train.optimizer", "muon", "--train.muon_groups", "attention", "router", "embeddings", "head"],
], ids=["adamw", "muon", "muon_mla_shared", "muon_router_ends"])
def test_optimizer_state_is_what_the_optimizer_holds(extra):
    cfg = parse_job_args([*SMALL, *extra])
    assert training_memory_breakdown(cfg, 1).optimizer == _held_state_bytes(cfg)


def test_estimate_names_the_optimizer(capsys):
    assert cli.main(["estimate", *SMALL, "--skip-data"]) == 0
    adamw = capsys.readouterr().out
    assert cli.main(["estimate", *SMALL, "--skip-data", "--train.optimizer", "muon"]) == 0
    muon = capsys.readouterr().out
    assert "(AdamW: 2 float32 moments" in adamw and "Muon" not in adamw
    assert "(Muon: 1 float32 momentum buffer on its" in muon and "attention, dense_ffn, experts" in muon
