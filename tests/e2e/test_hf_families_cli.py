"""Every Hugging Face family end to end through the CLI: train, `moetrain export-hf`, load in transformers.

- A family preset (`PRESETS`: configs/gpt_oss_tiny.toml, configs/deepseek_v3_debug.toml) trains 3 steps on
  CPU and exports as its transformers class, which loads with no missing or unexpected keys and the
  run's logits.
- A Hugging Face directory (a tiny model of `hf_tiny.VARIANTS`) fine-tuned for 3 steps with
  `moetrain train --model.init_from hf:DIR`, exported, gives transformers moetrain's logits.
- Bad directories and mismatched jobs fail in one line with exit status 2 and write nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import hf_tiny
from moetrain import cli
from moetrain.checkpoint.layout import latest_complete
from moetrain.checkpoint.storage import load_model_weights
from moetrain.config.job import JobConfig
from moetrain.model.transformer import Transformer
from moetrain.runtime.run_dir import RunDir

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def trained_model(run_dir: Path) -> Transformer:
    """The model of a run's latest complete checkpoint, in eval mode."""
    cfg = RunDir(run_dir).load_config()
    model = Transformer(cfg.model)
    model.init_weights(seed=0)
    load_model_weights(latest_complete(RunDir(run_dir).checkpoints), model)
    return model.eval()


def gpt_oss_trained(model: Transformer, run_dir: Path, out: Path) -> None:
    assert model.layers[0].attention.sinks.abs().max() > 0  # trained away from the zero init


def deepseek_v3_trained(model: Transformer, run_dir: Path, out: Path) -> None:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len([r for r in records if r["kind"] == "train"]) == 3
    config = json.loads((out / "config.json").read_text())
    assert (config["architectures"], config["n_group"], config["topk_group"], config["kv_lora_rank"]) == (
        ["DeepseekV3ForCausalLM"], 8, 4, 64)
    assert any(float(moe.expert_bias.abs().max()) > 0 for moe in model.moe_layers())  # the bias was updated


# preset -> (its own arguments, the transformers class it exports as, test sequence length, what its run shows)
PRESETS = {
    # sequences longer than the 64-token window, trained with the memory-efficient experts
    "gpt_oss_tiny": (["--data.seq_len", "96", "--data.heldout_fraction", "0.2", "--train.microbatch_size", "1"],
                     "GptOssForCausalLM", 150, gpt_oss_trained),
    # the preset's shapes (MLA, group-limited sigmoid routing, a shared expert, aux-free balancing) on short
    # sequences, so three steps take seconds
    "deepseek_v3_debug": (["--data.seq_len", "64", "--logging.log_every", "1"], "DeepseekV3ForCausalLM", 48,
                          deepseek_v3_trained),
}


@pytest.mark.parametrize("preset", PRESETS)
def test_family_preset_trains_then_exports_to_transformers(corpus_dir, tmp_path, preset):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    own_args, architecture_class, seq_len, check_run = PRESETS[preset]
    run_dir, out = tmp_path / "run", tmp_path / "export"
    argv = ["--config", str(CONFIGS / f"{preset}.toml"), "--data.source", "dir", "--data.path", str(corpus_dir),
            "--data.glob", "*.py", *own_args, "--train.steps", "3", "--train.warmup_steps", "1",
            "--train.eval_every", "0", "--train.sample_tokens", "0", "--checkpoint.every", "3",
            "--logging.run_dir", str(run_dir), "--logging.progress_bar", "False"]
    assert cli.main(["train", *argv]) == 0
    assert cli.main(["export-hf", "--run", str(run_dir), "--out", str(out)]) == 0
    model = trained_model(run_dir)
    check_run(model, run_dir, out)
    exported, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert type(exported).__name__ == architecture_class
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    tokens = torch.randint(0, 256, (2, seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert hf_tiny.relative_error(model(tokens), exported.float().eval()(tokens).logits) < 1e-5
    tokenizer = AutoTokenizer.from_pretrained(out)  # the byte tokenizer: a prompt starts as documents did
    assert tokenizer("def f")["input_ids"] == [256, *b"def f"] and tokenizer.bos_token_id == 256


def one_error_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("moetrain: error: "), lines
    return lines[0]


def test_fine_tune_then_export_gives_transformers_moetrains_logits(job_args, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    hf_model = hf_tiny.build_variant("qwen3_moe")
    directory = hf_tiny.save(hf_model, tmp_path / "qwen3")
    run_dir, out = tmp_path / "run", tmp_path / "export"
    argv = [*job_args(run_dir, train__steps=3, checkpoint__every=3, train__eval_every=0, train__grad_accum=2),
            *hf_tiny.architecture_args(directory), "--model.init_from", f"hf:{directory}",
            "--data.tokenizer", str(directory),
            "--model.moe.aux_loss_scope", "global_batch", "--model.moe.z_loss_coef", "0.001"]
    assert cli.main(["train", *argv]) == 0
    assert cli.main(["export-hf", "--run", str(run_dir), "--out", str(out)]) == 0
    assert cli.main(["sample", "--run", str(run_dir), "--max-tokens", "5"]) == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert len(train) == 3 and all(r["z_loss"] > 0 and r["aux_loss"] > 0 for r in train)

    model = trained_model(run_dir)
    exported, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs, before = model(tokens), exported(tokens).logits, hf_model(tokens).logits
    assert hf_tiny.relative_error(ours, theirs) < 1e-5
    assert hf_tiny.relative_error(ours, before) > 1e-4  # the 3 steps did change the model
    assert (out / "tokenizer.json").read_bytes() == (directory / "tokenizer.json").read_bytes()
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 257


def test_mismatched_or_unsupported_directories_fail_in_one_line_and_write_nothing(job_args, tmp_path, capsys):
    directory = hf_tiny.save(hf_tiny.build_variant("olmoe"), tmp_path / "olmoe")
    run_dir = tmp_path / "run"
    base = [*job_args(run_dir, train__steps=1), *hf_tiny.architecture_args(directory)]
    cases = {
        "model.dim = 48 but hidden_size gives 32": [*base, "--model.dim", "48", "--model.init_from", f"hf:{directory}",
                                                    "--data.tokenizer", str(directory)],
        # The directory's tokenizer is the default now; naming another one is refused.
        "carries its tokenizer: use --data.tokenizer": [*base, "--model.init_from", f"hf:{directory}",
                                                        "--data.tokenizer", "byte"],
        "does not exist": [*base, "--model.init_from", f"hf:{tmp_path / 'missing'}"],
    }
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    cases["model_type = 'llama' is not a supported family"] = [*base, "--model.init_from", f"hf:{llama}"]
    capsys.readouterr()  # save_pretrained's progress bar
    for expected, argv in cases.items():
        assert cli.main(["train", *argv]) == 2, expected
        assert expected in one_error_line(capsys), expected
        assert not run_dir.exists(), expected


def test_export_errors_name_the_problem(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = JobConfig()
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict()))
    assert cli.main(["export-hf", "--run", str(run_dir), "--out", str(tmp_path / "out")]) == 2
    # the default shape (no QK-norm) is Mixtral's kind, but Mixtral has no dense first layer
    assert "model.n_dense_layers = 1 cannot be exported" in one_error_line(capsys)
    cfg.model.qk_norm = "per_head"
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict()))
    assert cli.main(["export-hf", "--run", str(run_dir), "--out", str(tmp_path / "out")]) == 2
    assert "has no complete checkpoint" in one_error_line(capsys)
    assert not (tmp_path / "out").exists()
