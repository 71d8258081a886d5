"""`moetrain estimate` under expert parallelism: each rank's experts and their all-gather, and what it assumed.

DeepSeek-V3 on 256 H200s at ep 1, 8 and 64: the expert weights a rank holds are the same share (the
experts are sharded over ep x dp_shard/ep = dp_shard ranks either way), but FSDP gathers only the
rank's E/ep experts of a block, over the dp_shard/ep ranks holding them, and the experts' input
arrives by all-to-all and is kept for backward; closed forms from the preset's numbers. The measured
agreement with peak RSS on 2 and 4 gloo ranks is in docs/results.md (benchmarks/profile/estimate_accuracy.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moetrain import cli

PRESET = Path(__file__).resolve().parents[2] / "configs" / "deepseek_v3_671b.toml"
DIM, LAYERS, DENSE, EXPERTS, HIDDEN, TOP_K, SEQ, VOCAB = 7168, 61, 3, 256, 2048, 8, 4096, 129280
EXPERT_PARAMS = (LAYERS - DENSE) * EXPERTS * 3 * DIM * HIDDEN  # w1 (gate and up) and w2 of every routed expert
WORLD = 256


def _estimate(capsys, ep: int) -> dict:
    argv = ["estimate", "--config", str(PRESET), "--world", str(WORLD), "--device", "H200", "--parallel.ep", str(ep),
            "--train.microbatch_size", "1"]
    assert cli.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_deepseek_v3_at_ep_1_8_64_counts_each_ranks_experts(capsys):
    runs = {ep: _estimate(capsys, ep) for ep in (1, 8, 64)}
    peaks = [runs[ep]["peak_bytes"] for ep in (1, 8, 64)]
    assert len(set(peaks)) == 3, peaks
    for ep, run in runs.items():
        parts = run["parts"]
        experts = run["experts"]
        assert experts["weights_bytes"] == pytest.approx(4 * EXPERT_PARAMS / WORLD, rel=1e-6)
        assert parts["weights"] == parts["gradients"] == parts["optimizer"] // 2
        # bfloat16 rows of every MoE layer's received tokens (top_k copies) and their gate scores
        assert experts["exchange_bytes"] == (0 if ep == 1 else (LAYERS - DENSE) * SEQ * TOP_K * (DIM + 1) * 2)
    # FSDP all-gathers (two blocks in bfloat16, one block's float32 gradients) the largest block: a MoE layer's
    # non-expert parameters and 1/ep of its experts, or the (untied) embedding
    embedding = VOCAB * DIM
    outside = (runs[1]["parameters"]["total"] - 2 * embedding - EXPERT_PARAMS) / LAYERS
    for ep, run in runs.items():
        block = max(outside + EXPERT_PARAMS / (LAYERS - DENSE) / ep, embedding)
        assert run["parts"]["fsdp_buffers"] == pytest.approx((2 * 2 + 4) * block, rel=1e-6)


def test_the_report_says_the_microbatch_and_the_experts_it_assumed(capsys):
    argv = ["estimate", "--config", str(PRESET), "--world", str(WORLD), "--device", "H200", "--parallel.ep", "8",
            "--train.microbatch_size", "2", "--data.seq_len", "1024"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "train.microbatch_size 2 x data.seq_len 1024 tokens per microbatch" in out
    assert "32 of 256 experts per MoE layer on this rank (ep 8), FSDP-sharded over 32 rank(s)" in out
