"""In-loop task evaluation (`evaluate.tasks.evaluate_choice_tasks`) split over 2 gloo ranks on an FSDP- and on an
expert-parallel-sharded model equals 1 rank, and both equal an independent float64 loop: one forward per
choice, log-likelihoods summed by hand, acc / acc_norm by numpy's argmax (lm-evaluation-harness's rule)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.config.parallel import ParallelConfig
from moetrain.data.tokenizer import build_tokenizer
from moetrain.evaluate.tasks import evaluate_choice_tasks, read_choice_tasks
from moetrain.testing import run_on_ranks
from moetrain.train.build import build_model

TASK = Path(__file__).resolve().parents[1] / "data" / "tasks" / "tiny_choice.jsonl"
MODEL_CFG = ModelConfig(vocab_size=272, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, n_dense_layers=1,
                        max_seq_len=64, moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, impl="loop"))
MAX_LENGTH = 40


def _scores(parallel: dict | None) -> dict:
    from moetrain.parallel.collectives import rank_and_world
    from moetrain.parallel.mesh import JobMesh

    rank, world = rank_and_world()
    if parallel is None:
        model = build_model(MODEL_CFG, seed=1)
    else:
        pcfg = ParallelConfig(**parallel)
        model = build_model(MODEL_CFG, pcfg, JobMesh.from_config(pcfg, world, "cpu"), "cpu", seed=1)
    return evaluate_choice_tasks(model, build_tokenizer("byte"), read_choice_tasks([str(TASK)]), batch_size=3,
                                 device="cpu", max_length=MAX_LENGTH, rank=rank, world=world)


def _reference() -> dict:
    model = build_model(MODEL_CFG, seed=1).double().eval()
    tokenizer = build_tokenizer("byte")
    task = read_choice_tasks([str(TASK)])[0]
    acc, acc_norm = [], []
    for doc in task.docs:
        lls = []
        for choice in doc["choices"]:
            context = [tokenizer.bos_id, *tokenizer.encode(doc["query"]).tolist()]
            whole = [tokenizer.bos_id, *tokenizer.encode(doc["query"] + " " + choice).tolist()]
            continuation = whole[len(context):]
            tokens = whole[-(MAX_LENGTH + 1):]
            with torch.no_grad():
                logprobs = torch.log_softmax(model(torch.tensor([tokens[:-1]]))[0], -1)
            lls.append(sum(float(logprobs[len(tokens) - 1 - len(continuation) + i, t])
                           for i, t in enumerate(continuation)))
        acc.append(float(np.argmax(lls) == doc["gold"]))
        acc_norm.append(float(np.argmax(np.array(lls) / [len(c) for c in doc["choices"]]) == doc["gold"]))
    return {"task/tiny_choice/acc": float(np.mean(acc)), "task/tiny_choice/acc_norm": float(np.mean(acc_norm))}


@pytest.mark.parametrize("parallel", [dict(dp_shard=2), dict(dp_shard=2, ep=2)], ids=["fsdp", "ep"])
def test_two_ranks_score_like_one_rank_and_a_float64_loop(parallel):
    one = _scores(None)
    two = run_on_ranks(_scores, 2, parallel)
    assert two[0] == two[1] == one
    reference = _reference()
    assert one == pytest.approx(reference, abs=1e-12)
    assert 0 < one["task/tiny_choice/acc"] < 1 or 0 < one["task/tiny_choice/acc_norm"] < 1  # not degenerate
