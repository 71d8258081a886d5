"""LoRA adapters exported as PEFT adapter directories, against transformers + peft's own computation.

For Qwen3-MoE (grouped-query attention in moetrain's interleaved RoPE layout), DeepSeek-V3 (MLA with its
low-rank projections, a dense layer, shared experts) and GPT-OSS (interleaved gate/up experts, a router
with a bias) tiny random models: a few AdamW steps with every target the model has, then

- `peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), DIR)` computes moetrain's
  logits to 1e-5 relative (float32), and PEFT loads every tensor (no missing adapter key);
- the `--lora merged` path (adapters folded in, `save_hf`) loads in plain transformers with the same logits;
- the directory read back (`lora.init_from`) gives the adapters bit for bit;
- per-expert and shared expert adapters both export (a shared one as equal per-expert blocks).

Without the layout maps (PEFT's [E·r, in] / [out, r·E] blocks, the nesting of gate_up_proj under
down_proj, GPT-OSS's interleaving, the RoPE row order) the logits differ by far more than the tolerance.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import hf_tiny
from hf_tiny import build_variant, relative_error, tokens, train_steps
from moetrain.config.lora import LoraConfig, target_widths
from moetrain.interop import hf_job_config, save_hf
from moetrain.interop.peft_adapter import load_peft_adapter, save_peft_adapter
from moetrain.model.lora import adapter_parameters, merge_adapters
from moetrain.train.build import build_model

TOL = 1e-5


def lora_job(directory, expert_mode="per_expert", rank=2):
    """The job of a tiny directory with every target its model has, the correction bias held fixed."""
    cfg = hf_job_config(directory)
    moe = dataclasses.replace(cfg.model.moe, bias_update_rate=0.0)
    layout = "interleaved" if cfg.model.kv_lora_rank is None and cfg.model.partial_rotary_factor == 1 \
        else cfg.model.rope_layout
    model_cfg = dataclasses.replace(cfg.model, moe=moe, rope_layout=layout)
    targets = [t for t in ("attention", "ffn", "shared_experts", "experts", "router") if t in target_widths(model_cfg)]
    lora = LoraConfig(rank=rank, alpha=3.0, targets=targets, expert_mode=expert_mode)
    return dataclasses.replace(cfg, model=model_cfg, lora=lora).validate()


def trained(cfg, directory, steps=3):
    model = build_model(cfg.model, weights=f"hf:{directory}", lora=cfg.lora)
    train_steps(model, steps, lr=2e-2, update_expert_bias=False)
    return model


@pytest.mark.parametrize("variant, expert_mode", [("qwen3_moe", "per_expert"), ("deepseek_v3", "per_expert"),
                                                  ("gpt_oss", "per_expert"), ("qwen3_moe", "shared"),
                                                  ("mixtral", "per_expert")])
def test_peft_loads_the_adapters_with_moetrains_logits(tmp_path, variant, expert_mode):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf_model = build_variant(variant)
    directory = hf_tiny.save(hf_model, tmp_path / "base")
    cfg = lora_job(directory, expert_mode)
    model = trained(cfg, directory)
    x = tokens(seed=1)
    with torch.no_grad():
        ours = model(x)
        base_logits = hf_model(x).logits
    assert relative_error(ours, base_logits) > 1e-3  # the adapters moved the model
    out = save_peft_adapter(model, cfg, tmp_path / "adapter")
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(directory), out).float().eval()
    trainable = {n for n, _ in peft_model.named_parameters() if "lora_" in n}
    assert len(trainable) == len(adapter_parameters(model))  # every adapter of ours is one of PEFT's
    with torch.no_grad():
        assert relative_error(ours, peft_model(x).logits) < TOL
    # the directory read back gives the same adapters
    again = build_model(cfg.model, weights=f"hf:{directory}", lora=cfg.lora)
    load_peft_adapter(again, cfg, out)
    for name, param in adapter_parameters(model).items():
        assert torch.equal(param, adapter_parameters(again)[name]), name
    # merged: the adapters folded into the weights, a plain Hugging Face directory
    merge_adapters(model)
    merged = AutoModelForCausalLM.from_pretrained(save_hf(model, cfg, tmp_path / "merged")).float().eval()
    with torch.no_grad():
        assert relative_error(ours, model(x)) < TOL
        assert relative_error(ours, merged(x).logits) < TOL
