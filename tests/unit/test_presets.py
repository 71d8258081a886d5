"""Real-size presets: parameter counts of the model built on the meta device against the published totals.

Published totals (the figure each model's own publication gives for all parameters, embeddings included):
- GPT-OSS-20B 20.9 B and GPT-OSS-120B 116.8 B: OpenAI, "gpt-oss-120b & gpt-oss-20b Model Card"
  (August 2025), Table 1 (20.91 B total / 3.61 B active; 116.83 B total / 5.13 B active).
- Mixtral-8x7B 46.7 B: Mistral AI, "Mixtral of experts" (blog, December 2023; arXiv 2401.04088):
  "46.7B total parameters but only uses 12.9B parameters per token".
- Qwen2-57B-A14B 57.4 B: the Qwen/Qwen2-57B-A14B model card ("57B total, 14B activated"; its
  safetensors index totals 57.4 B parameters).
Each must be within 0.5%. `count_params` (flops.py, used for MFU) must equal the built model's count.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import GptOssConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from moetrain.config.job import load
from moetrain.interop import export_family
from moetrain.model.flops import count_params
from moetrain.model.layers import rope_inv_freq
from moetrain.model.transformer import Transformer

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PUBLISHED = {
    "gpt_oss_20b": (20.9e9, "gpt_oss"),
    "gpt_oss_120b": (116.8e9, "gpt_oss"),
    "mixtral_8x7b": (46.7e9, "mixtral"),
    "qwen2_57b_a14b": (57.4e9, "qwen2_moe"),
}


@pytest.mark.parametrize("preset", PUBLISHED)
def test_meta_parameter_count_matches_the_published_total(preset):
    published, family = PUBLISHED[preset]
    cfg = load(CONFIGS / f"{preset}.toml")
    with torch.device("meta"):
        model = Transformer(cfg.model)
    total = sum(p.numel() for p in model.parameters())
    assert abs(total - published) / published < 0.005, (preset, total)
    assert count_params(cfg.model)["total"] == total
    assert export_family(cfg.model) == family


def test_active_parameters_of_gpt_oss_match_the_model_card():
    """The model card's active counts (3.61 B, 5.13 B) include the embedding row and the head."""
    for preset, active in (("gpt_oss_20b", 3.61e9), ("gpt_oss_120b", 5.13e9)):
        counted = count_params(load(CONFIGS / f"{preset}.toml").model)["active"]
        assert abs(counted - active) / active < 0.005, (preset, counted)


def test_the_tiny_gpt_oss_preset_is_gpt_oss_shaped():
    cfg = load(CONFIGS / "gpt_oss_tiny.toml").model
    assert export_family(cfg) == "gpt_oss"
    windows = [cfg.window_of(i) for i in range(cfg.n_layers)]
    assert windows == [64, None, 64, None]
    with torch.device("meta"):
        model = Transformer(cfg)
    names = {name for name, _ in model.named_parameters()}
    assert {"layers.0.attention.sinks", "layers.0.attention.wo.bias", "layers.0.moe.router.bias",
            "layers.0.moe.experts.b1", "layers.0.moe.experts.b2"} <= names
    assert count_params(cfg)["total"] == sum(p.numel() for p in model.parameters())


# rope_parameters of openai/gpt-oss-20b and -120b's config.json (both ship the same).
RELEASED_GPT_OSS_ROPE = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}


@pytest.mark.parametrize("preset", ["gpt_oss_20b", "gpt_oss_120b"])
def test_gpt_oss_presets_compute_the_released_yarn_rope(preset):
    cfg = load(CONFIGS / f"{preset}.toml").model
    hf = GptOssConfig(hidden_size=cfg.dim, num_attention_heads=cfg.n_heads, head_dim=cfg.head_dim,
                      max_position_embeddings=131072, rope_parameters=dict(RELEASED_GPT_OSS_ROPE))
    expected_inv_freq, expected_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    inv_freq, factor = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg, torch.device("cpu"))
    torch.testing.assert_close(inv_freq, expected_inv_freq, rtol=0, atol=1e-9)
    assert factor == pytest.approx(expected_factor, rel=1e-12) and cfg.max_seq_len == 131072


def test_gpt_oss_120b_preset_has_an_expert_parallel_layout_that_estimate_accepts_and_fits(capsys):
    """The preset's own layout (EP 8 within each machine, FSDP over the rest) through `moetrain estimate`
    on 8 x 8 H100: accepted (the experts' biases move with their experts under EP) and within 80 GiB."""
    import json

    from moetrain import cli

    cfg = load(CONFIGS / "gpt_oss_120b.toml")
    assert cfg.parallel.ep == 8 and cfg.model.moe.n_experts % cfg.parallel.ep == 0
    code = cli.main(["estimate", "--config", str(CONFIGS / "gpt_oss_120b.toml"), "--nodes", "8", "--gpus-per-node",
                     "8", "--device", "H100", "--skip-data", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["world"] == 64 and result["fits"] is True, result
    assert result["peak_bytes"] < result["available_bytes"]
