"""What a user types after a run, answered in one line: a changed train.steps after a finished run (as
`make train ARGS="--train.steps 50"` passes it, with --checkpoint.resume auto)."""

from __future__ import annotations

import json

from moetrain import cli


def test_fewer_steps_after_a_finished_run_says_nothing_is_trained(job_args, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert cli.main(["train", *job_args(run_dir, train__steps=3, checkpoint__every=3, train__eval_every=0)]) == 0
    metrics = (run_dir / "metrics.jsonl").read_text()
    capsys.readouterr()
    again = job_args(run_dir, train__steps=2, checkpoint__every=3, train__eval_every=0, train__warmup_steps=1)
    assert cli.main(["train", *again, "--checkpoint.resume", "auto"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and "train.steps = 2 trains nothing" in err[0] and "reached step 3" in err[0], err
    assert (run_dir / "metrics.jsonl").read_text() == metrics  # the finished run's record is left as it was


def test_sample_stops_at_generation_configs_eos_and_chats_with_the_template(job_args, tmp_path, capsys):
    from chat_fixtures import TEMPLATES, tokenizer_dir

    directory = tokenizer_dir(tmp_path / "tok", TEMPLATES["qwen_chatml"])
    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": f"Colour {i} of the sky?"}) + "\n" for i in range(40)))
    run_dir = tmp_path / "run"
    argv = job_args(run_dir, train__steps=2, checkpoint__every=2, train__eval_every=0, data__source="jsonl",
                    data__path=str(texts), model__vocab_size=512, train__warmup_steps=1)
    assert cli.main(["train", *argv, "--data.tokenizer", str(directory)]) == 0
    capsys.readouterr()
    # every id an EOS of generation_config.json: whatever the model says first ends the sample
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": list(range(512))}))
    assert cli.main(["sample", "--run-dir", str(run_dir), "--prompt", "blue", "--max-tokens", "20"]) == 0
    assert "; 1 new token(s), stopped at an end token" in capsys.readouterr().out
    (directory / "generation_config.json").unlink()
    assert cli.main(["sample", "--run-dir", str(run_dir), "--prompt", "hello", "--max-tokens", "3", "--chat"]) == 0
    out = capsys.readouterr().out
    assert "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n" in out, out
