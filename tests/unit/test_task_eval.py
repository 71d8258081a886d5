"""Local task files and lm-evaluation-harness's scoring rules (evaluate.tasks), against hand-worked cases
and an unbatched float64 forward per request."""

import json

import pytest
import torch

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.errors import ConfigError
from moetrain.evaluate.tasks import (
    choice_metrics,
    encode_pair,
    read_choice_tasks,
    read_task,
    score_continuations,
)
from moetrain.train.build import build_model

BOS = 99
encode = lambda text: [ord(c) for c in text]  # one token per character


def test_encode_pair_moves_trailing_spaces_to_the_continuation_and_starts_with_bos():
    assert encode_pair(encode, BOS, "Q:", " a") == ([BOS, ord("Q"), ord(":")], [ord(" "), ord("a")])
    # "Q: " + "a": the space belongs to the continuation, as in lm-evaluation-harness's TemplateLM
    assert encode_pair(encode, BOS, "Q: ", "a") == ([BOS, ord("Q"), ord(":")], [ord(" "), ord("a")])
    assert encode_pair(encode, BOS, "", "ab") == ([BOS], [ord("a"), ord("b")])


def test_acc_and_acc_norm_follow_lm_eval_with_ties_to_the_first_choice():
    # log-likelihoods -3 (1 char) and -4 (4 chars): acc picks choice 0, acc_norm (-3 vs -1 per char) choice 1
    assert choice_metrics([-3.0, -4.0], ["a", "bbbb"], gold=1) == (0.0, 1.0)
    assert choice_metrics([-3.0, -4.0], ["a", "bbbb"], gold=0) == (1.0, 0.0)
    assert choice_metrics([-2.0, -2.0], ["xx", "yy"], gold=0) == (1.0, 1.0)  # a tie goes to the first
    assert choice_metrics([-2.0, -2.0], ["xx", "yy"], gold=1) == (0.0, 0.0)


def test_batched_scores_equal_one_float64_forward_per_request_with_left_truncation():
    cfg = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=64,
                      moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, impl="loop"))
    model = build_model(cfg, seed=2).double().eval()
    gen = torch.Generator().manual_seed(0)
    requests = [(torch.randint(0, 64, (n,), generator=gen).tolist(), torch.randint(0, 64, (m,), generator=gen).tolist())
                for n, m in ((1, 3), (7, 1), (4, 4), (20, 5), (2, 2))]
    max_length = 12  # the (20, 5) request is cut from the left
    got = score_continuations(model, requests, batch_size=2, device="cpu", max_length=max_length)
    for (context, continuation), (logprob, greedy) in zip(requests, got, strict=True):
        tokens = (context + continuation)[-(max_length + 1):]
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([tokens[:-1]]))[0], -1)
        rows = logprobs[len(tokens) - 1 - len(continuation):]
        want = sum(float(rows[i, t]) for i, t in enumerate(continuation))
        assert logprob == pytest.approx(want, abs=1e-10)
        assert greedy == all(int(rows[i].argmax()) == t for i, t in enumerate(continuation))


def test_task_files_are_checked_in_one_line_naming_the_file(tmp_path):
    def write(name, *lines):
        path = tmp_path / name
        path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
        return path

    good = write("mc.jsonl", {"query": "q", "choices": ["a", "b"], "gold": 1}, "", {"query": "r", "choices": ["c", "d"],
                                                                                    "gold": 0})
    task = read_task(good)
    assert (task.name, task.kind, len(task.docs)) == ("mc", "multiple_choice", 2)
    assert read_task(write("ppl.jsonl", {"text": "hello"})).kind == "perplexity"
    cases = {
        "is not JSON": write("a.jsonl", "{nope"),
        "gold = 2 is invalid": write("b.jsonl", {"query": "q", "choices": ["a", "b"], "gold": 2}),
        "at least 2 non-empty strings": write("c.jsonl", {"query": "q", "choices": ["a"], "gold": 0}),
        "must be {\"query\"": write("d.jsonl", {"question": "q"}),
        "mixes multiple-choice and perplexity": write("e.jsonl", {"text": "t"},
                                                      {"query": "q", "choices": ["a", "b"], "gold": 0}),
        "has no documents": write("f.jsonl", ""),
        "does not exist": tmp_path / "missing.jsonl",
    }
    for message, path in cases.items():
        with pytest.raises(ConfigError, match=message.replace("{", r"\{")) as err:
            read_task(path)
        assert "\n" not in str(err.value) and "train.eval_tasks" in str(err.value)
    with pytest.raises(ConfigError, match="is a perplexity task"):
        read_choice_tasks([str(tmp_path / "ppl.jsonl")])
    (tmp_path / "other").mkdir()
    twin = tmp_path / "other" / "mc.jsonl"
    twin.write_text(good.read_text())
    with pytest.raises(ConfigError, match="share a name"):
        read_choice_tasks([str(good), str(twin)])
