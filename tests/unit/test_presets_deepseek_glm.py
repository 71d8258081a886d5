"""Real-size presets (DeepSeek-V3 671B, Kimi-K2, Moonlight-16B-A3B, GLM-4.5-Air): parameter counts on the meta device.

Three references: transformers' own model built on the meta device from the config.json moetrain
would export for the preset (total parameters equal exactly, so the preset and the export carry
the published shapes and MLA / shared experts are counted like transformers builds them); the
meta model itself for `count_params`' total and active counts (active = every non-expert
parameter but the unused embedding rows, plus top_k / n_experts of the routed experts); and the
figures the model makers publish, which are rounded (to whole billions, or to "1T"): the total
must be within 0.5% where the publisher gives three significant digits that count what
moetrain counts, and every count must round to the published figure at its published precision.
"""

from __future__ import annotations

import pytest
import torch

from moetrain.config.job import load
from moetrain.data.tokenizer import build_tokenizer
from moetrain.interop import families
from moetrain.model.flops import count_params
from moetrain.model.transformer import Transformer

B, T = 1e9, 1e12
# preset -> (published total, published active, unit they are rounded to, what they count, source).
# "all": every parameter (ours as counted); "non_embedding": the embedding and output matrices left
# out (GLM-4.5-Air's figures match only that way: 106.85 B / 12.80 B with them, 106.23 B / 12.18 B without).
PUBLISHED = {
    "deepseek_v3_671b": (671 * B, 37 * B, B, "all",
                         "DeepSeek-V3 Technical Report, arXiv 2412.19437, abstract: 671B total, 37B activated"),
    "kimi_k2": (1 * T, 32 * B, {"total": T, "active": B}, "all",
                "Kimi K2 model card (huggingface.co/moonshotai/Kimi-K2-Instruct): 1T total, 32B activated"),
    "moonlight_16b_a3b": (16 * B, 3 * B, B, "all",
                          "Muon is Scalable for LLM Training, arXiv 2502.16982, abstract: a 3B/16B-parameter MoE"),
    "glm45_air": (106 * B, 12 * B, B, "non_embedding",
                  "GLM-4.5 README (github.com/zai-org/GLM-4.5): 106 billion total, 12 billion active"),
}
# Totals the publisher states to three significant digits, for the 0.5% check.
WITHIN_HALF_PERCENT = ("deepseek_v3_671b", "moonlight_16b_a3b", "glm45_air")


def meta_model(preset: str):
    cfg = load(f"configs/{preset}.toml").model
    with torch.device("meta"):
        return cfg, Transformer(cfg)


def transformers_meta_total(cfg) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = families.export_family_of(cfg).config_json(cfg, build_tokenizer("byte"), torch.bfloat16)
    for key in ("architectures", "dtype"):
        config.pop(key)
    hf_config = AutoConfig.for_model(config.pop("model_type"), **config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("preset", PUBLISHED)
def test_preset_total_equals_transformers_and_count_params_equals_the_meta_model(preset):
    cfg, model = meta_model(preset)
    total = sum(p.numel() for p in model.parameters())
    assert total == transformers_meta_total(cfg)
    counts = count_params(cfg)
    assert counts["total"] == total
    experts = sum(p.numel() for name, p in model.named_parameters() if ".moe.experts." in name)
    unused_rows = (cfg.vocab_size - 1) * cfg.dim if not cfg.tie_embeddings else 0
    active = total - experts + experts * cfg.moe.top_k // cfg.moe.n_experts - unused_rows
    assert counts["active"] == active


@pytest.mark.parametrize("preset", PUBLISHED)
def test_preset_counts_match_the_published_figures(preset):
    total_published, active_published, unit, convention, source = PUBLISHED[preset]
    cfg = load(f"configs/{preset}.toml").model
    counts = count_params(cfg)
    total, active = counts["total"], counts["active"]
    if convention == "non_embedding":
        matrices = cfg.vocab_size * cfg.dim * (1 if cfg.tie_embeddings else 2)
        total, active = total - matrices, active - cfg.vocab_size * cfg.dim - (0 if cfg.tie_embeddings else cfg.dim)
    units = unit if isinstance(unit, dict) else {"total": unit, "active": unit}
    assert round(total / units["total"]) * units["total"] == total_published, (preset, total, source)
    assert round(active / units["active"]) * units["active"] == active_published, (preset, active, source)
    if preset in WITHIN_HALF_PERCENT:
        assert abs(total / total_published - 1) <= 0.005, (preset, total, source)


def test_debug_preset_is_deepseek_v3_shaped_and_exports_as_deepseek_v3():
    cfg = load("configs/deepseek_v3_debug.toml")
    m = cfg.model
    assert m.kv_lora_rank and m.q_lora_rank and m.n_dense_layers == 1 and m.moe.n_shared_experts == 1
    assert (m.moe.score_func, m.moe.load_balance, m.moe.n_group > 1, m.moe.topk_group < m.moe.n_group) == (
        "sigmoid", "aux_free", True, True)
    assert families.export_family_of(m).model_type == "deepseek_v3"
