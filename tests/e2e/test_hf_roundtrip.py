"""Fine-tune a Hugging Face directory for 3 steps with `moetrain train --model.init_from hf:DIR`, export it
with `moetrain export-hf`, load it with transformers: same logits as moetrain's own checkpoint. Bad
directories and mismatched jobs fail in one line with exit status 2 and write nothing."""

from __future__ import annotations

import json

import torch

import hf_tiny
from moetrain import cli
from moetrain.interop import architecture, hf_job_config
from moetrain.model.transformer import Transformer
from moetrain.runtime.run_dir import RunDir
from moetrain.train.checkpoint import latest_complete, load_model_weights


def architecture_args(directory) -> list[str]:
    """--model.* overrides describing the directory's architecture (the TOML must agree with config.json)."""
    cfg = hf_job_config(directory)
    args = []
    for name, value in architecture(cfg.model).items():
        if value is not None:
            args += [f"--model.{name}", str(value)]
    return args


def one_error_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("moetrain: error: "), lines
    return lines[0]


def test_fine_tune_then_export_gives_transformers_moetrains_logits(job_args, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    hf_model = hf_tiny.build("qwen3_moe", seed=2)
    directory = hf_tiny.save(hf_model, tmp_path / "qwen3")
    run_dir, out = tmp_path / "run", tmp_path / "export"
    argv = [*job_args(run_dir, train__steps=3, checkpoint__every=3, train__eval_every=0, train__grad_accum=2),
            *architecture_args(directory), "--model.init_from", f"hf:{directory}", "--data.tokenizer", str(directory),
            "--model.moe.aux_loss_scope", "global_batch", "--model.moe.z_loss_coef", "0.001"]
    assert cli.main(["train", *argv]) == 0
    assert cli.main(["export-hf", "--run", str(run_dir), "--out", str(out)]) == 0
    assert cli.main(["sample", "--run", str(run_dir), "--max-tokens", "5"]) == 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert len(train) == 3 and all(r["z_loss"] > 0 and r["aux_loss"] > 0 for r in train)

    cfg = RunDir(run_dir).load_config()
    model = Transformer(cfg.model)
    model.init_weights(seed=0)
    load_model_weights(latest_complete(RunDir(run_dir).checkpoints), model)
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
    directory = hf_tiny.save(hf_tiny.build("olmoe", seed=3), tmp_path / "olmoe")
    run_dir = tmp_path / "run"
    base = [*job_args(run_dir, train__steps=1), *architecture_args(directory)]
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
    from moetrain.config.job import JobConfig

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
