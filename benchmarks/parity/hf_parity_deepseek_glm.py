"""Measured logits differences between moetrain and transformers for DeepSeek-V3 and GLM-4.5.

    .venv/bin/python benchmarks/parity/hf_parity_deepseek_glm.py [--layers 3] [--json FILE]

(FILE defaults to benchmarks/results/hf_parity_deepseek_glm.json.)

DeepSeek-V3 at configs/deepseek_v3_debug.toml's widths (dim 256, 8 heads, q_lora_rank 96,
kv_lora_rank 64, qk_nope 32, qk_rope 16, v 32, 32 experts top-4 in 8 groups of which 4 are chosen,
routed_scaling_factor 2.5, one shared expert, first layer dense), also with no low-rank query path
and with YaRN (factor 4, mscale 0.9, mscale_all_dim 1); GLM-4.5 at reduced GLM-4.5-Air proportions
(dim 256, 8 query / 2 KV heads of width 64, q/k/v biases, partial rotary 0.5, 32 experts top-4,
one shared expert). transformers' random init with norm weights perturbed and a random correction
bias (std 0.05), float32, CPU, 2 × 128 tokens; packed: documents of 50, 7, 1 and 70 tokens;
export after 3 AdamW steps (lr 1e-3) with the aux-free bias update, reloaded with `from_pretrained`.
Numbers: max |diff| and max |diff| / max |logit| (the measure of benchmarks/parity/hf_parity.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from benchmarks.parity.hf_parity import (
    SPECIAL,
    diff,
    export_diff,
    packed_diff,
    run_all,
    saved_and_loaded,
    train_briefly,
)

YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 128,
        "mscale": 0.9, "mscale_all_dim": 1.0}
VARIANTS = {
    "deepseek_v3": ("deepseek_v3", {}),
    "deepseek_v3 (no q_lora_rank)": ("deepseek_v3", {"q_lora_rank": None}),
    "deepseek_v3 (yarn)": ("deepseek_v3", {"rope_parameters": YARN}),
    "glm4_moe": ("glm4_moe", {}),
}


def hf_model(family: str, layers: int, overrides: dict):
    from transformers import AutoModelForCausalLM, DeepseekV3Config, Glm4MoeConfig

    common = dict(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=layers,
                  moe_intermediate_size=128, n_routed_experts=32, num_experts_per_tok=4, n_shared_experts=1,
                  first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=512, **SPECIAL)
    if family == "deepseek_v3":
        fields = dict(num_attention_heads=8, num_key_value_heads=8, q_lora_rank=96, kv_lora_rank=64,
                      qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_group=8, topk_group=4,
                      routed_scaling_factor=2.5, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
        config = DeepseekV3Config(**{**common, **fields, **overrides})
    else:
        fields = dict(num_attention_heads=8, num_key_value_heads=2, head_dim=64, attention_bias=True,
                      n_group=1, topk_group=1, routed_scaling_factor=1.0,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5})
        config = Glm4MoeConfig(**{**common, **fields, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.mul_(1 + 0.3 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.normal_(0, 0.02)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.05)
    return model


def measure(variant: str, layers: int, work: Path) -> dict[str, dict[str, float]]:

    family, overrides = VARIANTS[variant]
    reference = hf_model(family, layers, overrides)
    directory = work / variant.replace(" ", "_")
    model, cfg = saved_and_loaded(reference, directory)
    tokens = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(1))
    out: dict[str, dict[str, float]] = {}
    with torch.no_grad():
        want = reference(tokens).logits
        out[f"import ({cfg.model.rope_layout} layout)"] = diff(model(tokens), want)
        out["packed documents vs per-document"] = packed_diff(model, reference, tokens)
    train_briefly(model, with_aux_loss=False)
    model.eval()
    return {**out, **export_diff(model, cfg, work / f"{directory.name}-export", tokens, want)}


def main() -> int:
    return run_all(VARIANTS, measure, "variant", 30, default_layers=3,
                   default_json="benchmarks/results/hf_parity_deepseek_glm.json")


if __name__ == "__main__":
    sys.exit(main())
