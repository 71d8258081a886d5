"""configs/gpt_oss_tiny.toml trains on CPU with the memory-efficient experts, and what it trained exports
as a GptOssForCausalLM that transformers loads with no missing keys and the same logits."""

from __future__ import annotations

from pathlib import Path

import torch

import hf_tiny
from moetrain import cli
from moetrain.checkpoint.layout import latest_complete
from moetrain.checkpoint.storage import load_model_weights
from moetrain.model.transformer import Transformer
from moetrain.runtime.run_dir import RunDir


def test_gpt_oss_tiny_trains_then_exports_to_transformers(corpus_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    run_dir, out = tmp_path / "run", tmp_path / "export"
    config = Path(__file__).resolve().parents[2] / "configs" / "gpt_oss_tiny.toml"
    argv = ["--config", str(config), "--data.source", "dir", "--data.path", str(corpus_dir),
            "--data.glob", "*.py", "--data.seq_len", "96", "--data.heldout_fraction", "0.2", "--train.steps", "3",
            "--train.warmup_steps", "1",
            "--train.microbatch_size", "1", "--train.eval_every", "0", "--train.sample_tokens", "0",
            "--checkpoint.every", "3", "--logging.run_dir", str(run_dir), "--logging.progress_bar", "False"]
    assert cli.main(["train", *argv]) == 0
    assert cli.main(["export-hf", "--run", str(run_dir), "--out", str(out)]) == 0
    cfg = RunDir(run_dir).load_config()
    model = Transformer(cfg.model)
    model.init_weights(seed=0)
    load_model_weights(latest_complete(RunDir(run_dir).checkpoints), model)
    assert model.layers[0].attention.sinks.abs().max() > 0  # trained away from the zero init
    exported, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(exported).__name__ == "GptOssForCausalLM"
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    tokens = torch.randint(0, 256, (2, 150), generator=torch.Generator().manual_seed(0))  # > the 64-token window
    model.eval()
    with torch.no_grad():
        assert hf_tiny.relative_error(model(tokens), exported.float().eval()(tokens).logits) < 1e-5
