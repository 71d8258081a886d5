"""Parameter and FLOP counts against a hand count on a tiny config and against the built model."""

import torch

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.model.flops import count_params, flops_per_token
from moetrain.model.transformer import Transformer


def hand_cfg(**overrides) -> ModelConfig:
    # V=11, d=8, L=3 (1 dense + 2 MoE), 2 query heads / 1 kv head of dim 4, dense hidden 12,
    # 4 experts of width 6, top-2, one shared expert.
    moe = MoEConfig(n_experts=4, top_k=2, expert_hidden=6, n_shared_experts=1)
    return ModelConfig(**{**dict(vocab_size=11, dim=8, n_layers=3, n_heads=2, n_kv_heads=1, ffn_hidden=12,
                                 n_dense_layers=1, moe=moe), **overrides})


def test_counts_match_a_hand_count():
    counts = count_params(hand_cfg())
    # attention per layer: wq 8x8 + wk 8x4 + wv 8x4 + wo 8x8 = 192; two RMSNorms 16 per layer
    # dense FFN 3 x 8 x 12 = 288; router 8 x 4 = 32; one expert 8 x 12 + 6 x 8 = 144; shared 3 x 8 x 6 = 144
    # total = embedding 88 + head 88 + final norm 8 + dense layer (192+288+16) + 2 x (192+32+144+4x144+16)
    assert counts["total"] == 88 + 88 + 8 + 496 + 2 * 960 == 2600
    assert counts["embedding"] == 88
    assert counts["routed_experts"] == 2 * 4 * 144
    # per token matmuls: head 88 + dense layer 480 + 2 x (192 + 32 + 144 + 2 x 144)
    assert counts["active_matmul"] == 88 + 480 + 2 * 656 == 1880
    assert counts["active"] == 1880 + 3 * 16 + 8 + 8
    # 6 N + 12 L H D_h S with S = 10
    assert flops_per_token(hand_cfg(), seq_len=10) == 6 * 1880 + 12 * 3 * 2 * 4 * 10


def test_total_matches_the_built_model_tied_and_untied_gelu_and_swiglu():
    for overrides in ({}, {"tie_embeddings": True},
                      {"moe": MoEConfig(n_experts=3, top_k=1, expert_hidden=5, activation="gelu")}):
        cfg = hand_cfg(**overrides)
        with torch.device("meta"):
            model = Transformer(cfg)
        assert count_params(cfg)["total"] == sum(p.numel() for p in model.parameters()), overrides
    assert count_params(hand_cfg(tie_embeddings=True))["total"] == 2600 - 88
