"""`moetrain sample` (greedy and nucleus sampling) and `moetrain plot` on a freshly trained tiny run."""

from __future__ import annotations

import struct

import pytest
import torch

from moetrain import cli
from moetrain.commands.sample import main as sample_main
from moetrain.errors import ConfigError
from moetrain.evaluate.generate import next_token, top_p_filter


def test_top_p_keeps_the_smallest_head_reaching_the_mass():
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3], dtype=torch.float64)
    torch.testing.assert_close(top_p_filter(probs, 0.7), torch.tensor([0, 0.625, 0, 0.375], dtype=torch.float64))
    torch.testing.assert_close(top_p_filter(probs, 0.8), torch.tensor([0, 0.625, 0, 0.375], dtype=torch.float64))
    torch.testing.assert_close(top_p_filter(probs, 0.81), torch.tensor([0.15, 0.5, 0, 0.3]) / 0.95,
                               check_dtype=False)
    torch.testing.assert_close(top_p_filter(probs, 0.01), torch.tensor([0, 1.0, 0, 0], dtype=torch.float64))
    assert torch.equal(top_p_filter(probs, 1.0), probs)


def test_next_token_greedy_and_sampled_frequencies():
    logits = torch.log(torch.tensor([0.1, 0.6, 0.3]))
    gen = torch.Generator().manual_seed(0)
    assert next_token(logits, 0.0, 1.0, gen) == 1
    draws = torch.tensor([next_token(logits, 1.0, 1.0, gen) for _ in range(3000)])
    freq = torch.bincount(draws, minlength=3).double() / 3000
    torch.testing.assert_close(freq, torch.tensor([0.1, 0.6, 0.3], dtype=torch.float64), atol=0.04, rtol=0)
    # top-p 0.5 leaves only the most likely token.
    assert {next_token(logits, 1.0, 0.5, gen) for _ in range(50)} == {1}


def test_sample_and_plot_commands_on_a_trained_run(job_args, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert cli.main(["train", *job_args(run_dir, train__steps=2, checkpoint__every=2, train__eval_every=1)]) == 0
    capsys.readouterr()
    argv = ["--run", str(run_dir), "--prompt", "def ", "--max-tokens", "8"]
    outputs = []
    for _ in range(2):
        assert sample_main(argv) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]  # greedy is deterministic
    header, text = outputs[0].split("\n", 1)
    assert "step 2, greedy" in header and text.startswith("def ")
    assert sample_main([*argv, "--temperature", "0.9", "--top-p", "0.9", "--seed", "3"]) == 0
    assert capsys.readouterr().out.split("\n", 1)[1].startswith("def ")
    with pytest.raises(ConfigError, match="--top-p = 1.5 is invalid"):
        sample_main([*argv, "--top-p", "1.5"])
    with pytest.raises(ConfigError, match="has no config.json"):
        sample_main(["--run", str(tmp_path / "nowhere")])

    out = tmp_path / "curve.png"
    assert cli.main(["plot", str(run_dir), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", out.read_bytes()[16:24])  # the IHDR chunk
    assert width <= 1800 and width / height <= 2.5, (width, height)  # panels in rows, readable at normal size
    assert cli.main(["plot", str(tmp_path)]) == 2  # not a run directory: one line, exit 2
