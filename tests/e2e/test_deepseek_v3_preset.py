"""configs/deepseek_v3_debug.toml trains on the embedded corpus on CPU, and `moetrain export-hf` writes a
DeepseekV3ForCausalLM directory that transformers loads with no missing or unexpected keys and the run's logits.

Run at the preset's shapes (MLA, group-limited sigmoid routing, a shared expert, aux-free balancing),
on short sequences so three steps take seconds."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import hf_tiny
from moetrain import cli
from moetrain.checkpoint.layout import latest_complete
from moetrain.checkpoint.storage import load_model_weights
from moetrain.model.transformer import Transformer
from moetrain.runtime.run_dir import RunDir

PRESET = Path(__file__).resolve().parents[2] / "configs" / "deepseek_v3_debug.toml"


def test_debug_preset_trains_then_exports_as_deepseek_v3(corpus_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    run_dir, out = tmp_path / "run", tmp_path / "export"
    argv = ["--config", str(PRESET), "--data.source", "dir", "--data.path", str(corpus_dir), "--data.glob", "*.py",
            "--data.seq_len", "64", "--train.steps", "3", "--train.warmup_steps", "1",
            "--train.eval_every", "0", "--train.sample_tokens", "0",
            "--checkpoint.every", "3", "--logging.run_dir", str(run_dir), "--logging.progress_bar", "False",
            "--logging.log_every", "1"]
    assert cli.main(["train", *argv]) == 0
    assert cli.main(["export-hf", "--run", str(run_dir), "--out", str(out)]) == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in records if r["kind"] == "train"]) == 3
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"], config["n_group"], config["topk_group"], config["kv_lora_rank"]) == (
        ["DeepseekV3ForCausalLM"], 8, 4, 64)

    cfg = RunDir(run_dir).load_config()
    model = Transformer(cfg.model)
    model.init_weights(seed=0)
    load_model_weights(latest_complete(RunDir(run_dir).checkpoints), model)
    model.eval()
    assert any(float(moe.expert_bias.abs().max()) > 0 for moe in model.moe_layers())  # the bias was updated
    exported, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert hf_tiny.relative_error(model(tokens), exported(tokens).logits) < 1e-5
