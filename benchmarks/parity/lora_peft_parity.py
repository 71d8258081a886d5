"""Measured logits differences between moetrain's LoRA models and transformers + peft, per family and target.

    PYTHONPATH=$PWD/src:$PWD python benchmarks/parity/lora_peft_parity.py [--json benchmarks/results/lora_peft.json]

For the tiny random Qwen3-MoE, DeepSeek-V3 (MLA, a dense layer, a shared expert) and GPT-OSS models of
tests/hf_tiny.py: each target the model has alone, then all of them together (and all of them with one
expert adapter shared by every expert), rank 2, 3 AdamW steps at lr 2e-2 (float32, CPU), then the
exported PEFT adapter directory loaded by `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(
BASE), DIR)` and the merged export loaded by transformers alone, against moetrain's logits on the same
tokens: max |diff| / max |logit|. The training's own movement (moetrain's logits against the base's) is
reported too, so a zero difference cannot come from adapters that did nothing. Measures; asserts nothing.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "unit"))

from test_lora_peft import lora_job, trained  # noqa: E402

import hf_tiny  # noqa: E402 (tests/ on the path first)
from moetrain.args import take_option  # noqa: E402
from moetrain.config.lora import target_widths  # noqa: E402
from moetrain.interop import save_hf  # noqa: E402
from moetrain.interop.peft_adapter import save_peft_adapter  # noqa: E402
from moetrain.model.lora import merge_adapters  # noqa: E402


def measure(variant: str, targets: list[str], expert_mode: str, tmp: Path) -> dict:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf_model = hf_tiny.build_variant(variant)
    directory = hf_tiny.save(hf_model, tmp / "base")
    cfg = lora_job(directory, expert_mode)
    cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, targets=targets)).validate()
    model = trained(cfg, directory)
    x = hf_tiny.tokens(seed=1)
    with torch.no_grad():
        ours = model(x)
        moved = hf_tiny.relative_error(ours, hf_model(x).logits)
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(directory),
                                         save_peft_adapter(model, cfg, tmp / "adapter")).float().eval()
        adapter = hf_tiny.relative_error(ours, peft(x).logits)
        merge_adapters(model)
        merged = AutoModelForCausalLM.from_pretrained(save_hf(model, cfg, tmp / "merged")).float().eval()
        merged_error = hf_tiny.relative_error(ours, merged(x).logits)
    return {"variant": variant, "targets": targets, "expert_mode": expert_mode, "training_moved": moved,
            "peft_adapter": adapter, "merged": merged_error}


def main(argv: list[str]) -> None:
    out, argv = take_option(argv, "json")
    variants, _ = take_option(argv, "variants")  # comma-separated; default every family below
    rows = []
    for variant in (variants.split(",") if variants else ("qwen3_moe", "deepseek_v3", "gpt_oss", "mixtral")):
        with tempfile.TemporaryDirectory() as tmp:
            cfg = lora_job(hf_tiny.save(hf_tiny.build_variant(variant), Path(tmp) / "probe"))
        present = [t for t in ("attention", "ffn", "shared_experts", "experts", "router")
                   if t in target_widths(cfg.model)]
        cases = [([t], "per_expert") for t in present] + [(present, "per_expert"), (present, "shared")]
        for targets, mode in cases:
            with tempfile.TemporaryDirectory() as tmp:
                rows.append(measure(variant, targets, mode, Path(tmp)))
            print(json.dumps(rows[-1]), flush=True)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
