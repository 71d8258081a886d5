"""`moetrain eval` against lm-evaluation-harness's own `hf` backend on the same exported directory, offline.

A tiny random Qwen3-MoE (transformers' own model, every weight redrawn) is imported into moetrain
and written back with moetrain's exporter (`save_hf`, byte tokenizer with its tokenizer_config).
moetrain's adapter and lm-evaluation-harness's `hf` backend then score the same local tasks:
every request's log-likelihood (multiple choice: BOS first on both sides, `add_bos_token=True`;
rolling perplexity: no BOS scored, `add_bos_token=False`, BOS as the prefix token on both),
the aggregated acc / acc_norm / perplexities, and greedy `generate_until` text.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

import hf_tiny
from moetrain import cli
from moetrain.commands.eval import EvalOptions, evaluate, summary
from moetrain.evaluate.harness import task_config
from moetrain.evaluate.tasks import read_task
from moetrain.interop import save_hf
from moetrain.train.build import load_hf_model

pytest.importorskip("lm_eval")
TASKS = Path(__file__).resolve().parents[1] / "data" / "tasks"
CHOICE, TEXT = TASKS / "tiny_choice.jsonl", TASKS / "tiny_text.jsonl"
MAX_LENGTH = 40  # shorter than the longest text: the rolling windows are exercised


def generation_task() -> dict:
    return {"task": "tiny_gen", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(CHOICE)}},
            "test_split": "test", "output_type": "generate_until", "doc_to_text": "{{query}}",
            "doc_to_target": "{{choices[gold]}}", "metadata": {"version": 1.0},
            "generation_kwargs": {"until": ["\n", "."], "max_gen_toks": 12, "do_sample": False},
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}]}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_HUB_OFFLINE", "1")
        env.setenv("HF_DATASETS_OFFLINE", "1")
        root = tmp_path_factory.mktemp("lm_eval")
        hf_tiny.save(hf_tiny.build("qwen3_moe", seed=4), root / "source")
        model, cfg = load_hf_model(root / "source")
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer="byte"),
                                  model=dataclasses.replace(cfg.model, init_from=None))
        yield save_hf(model, cfg, root / "export")


def per_request(results: dict, task: str) -> list:
    samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
    return [s["filtered_resps"] for s in samples]


def hf_backend(directory: Path, tasks: list, add_bos: bool) -> dict:
    import lm_eval

    return lm_eval.simple_evaluate(model="hf", tasks=tasks, batch_size=4, bootstrap_iters=0, log_samples=True,
                                   model_args=f"pretrained={directory},add_bos_token={add_bos},"
                                              f"max_length={MAX_LENGTH},dtype=float32,device=cpu")


@pytest.mark.timeout(900)  # three lm-evaluation-harness runs on a shared CPU
def test_adapter_matches_lm_eval_hf_backend(exported, monkeypatch):
    import lm_eval

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from moetrain.data.tokenizer import build_tokenizer
    from moetrain.evaluate.harness import harness_model

    model, cfg = load_hf_model(exported)
    lm = harness_model(model, build_tokenizer(cfg.data.tokenizer), batch_size=3, max_length=MAX_LENGTH)
    tasks = [task_config(read_task(CHOICE)), task_config(read_task(TEXT)), generation_task()]
    ours = lm_eval.simple_evaluate(model=lm, tasks=tasks, bootstrap_iters=0, log_samples=True)
    with_bos = hf_backend(exported, [tasks[0], tasks[2]], add_bos=True)
    without_bos = hf_backend(exported, [tasks[1]], add_bos=False)

    for task, reference in (("tiny_choice", with_bos), ("tiny_text", without_bos)):
        got, want = per_request(ours, task), per_request(reference, task)
        assert len(got) == len(want) > 0
        for g, w in zip(got, want, strict=True):
            g_ll = [r[0] if isinstance(r, list | tuple) else r for r in g]
            w_ll = [r[0] if isinstance(r, list | tuple) else r for r in w]
            assert max(abs(a - b) for a, b in zip(g_ll, w_ll, strict=True)) <= 1e-4, (task, g, w)
    assert per_request(ours, "tiny_gen") == per_request(with_bos, "tiny_gen")
    assert any(text[0] for text in per_request(ours, "tiny_gen"))  # something was generated

    got, want = summary(ours), {**summary(with_bos), **summary(without_bos)}
    for metric in ("tiny_choice/acc", "tiny_choice/acc_norm", "tiny_text/bits_per_byte",
                   "tiny_text/byte_perplexity", "tiny_gen/exact_match"):
        assert abs(got[f"task/{metric}"] - want[f"task/{metric}"]) <= 1e-4, metric
    # word perplexity of an untrained model is ~1e20: compare its logarithm (nats per word)
    assert abs(math.log(got["task/tiny_text/word_perplexity"]) - math.log(want["task/tiny_text/word_perplexity"])) \
        <= 1e-4
    print("measured |ours - hf|:", {m: abs(got[f"task/{m}"] - want[f"task/{m}"])
                                    for m in ("tiny_choice/acc", "tiny_choice/acc_norm", "tiny_text/bits_per_byte")})


def test_eval_command_on_hf_dir_writes_results_and_refuses_bad_input(exported, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    out = tmp_path / "results.json"
    assert cli.main(["eval", "--hf", str(exported), "--tasks", str(CHOICE), "--limit", "4", "--max_length",
                     str(MAX_LENGTH), "--out", str(out)]) == 0
    stored = json.loads(out.read_text())
    assert stored["results"]["tiny_choice"]["acc,none"] in {0.0, 0.25, 0.5, 0.75, 1.0}
    assert "task/tiny_choice/acc_norm" in capsys.readouterr().out
    # the same task as a custom lm-evaluation-harness YAML over the local JSONL, found through --include
    include = tmp_path / "my_tasks"
    include.mkdir()
    (include / "yaml_choice.yaml").write_text(
        f"task: yaml_choice\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {CHOICE}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{query}}\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{gold}}\"\nmetric_list:\n  - metric: acc\n"
        "  - metric: acc_norm\n")
    from_yaml = tmp_path / "yaml.json"
    assert cli.main(["eval", "--hf", str(exported), "--tasks", "yaml_choice", "--include", str(include), "--limit",
                     "4", "--max_length", str(MAX_LENGTH), "--out", str(from_yaml)]) == 0
    yaml_results = json.loads(from_yaml.read_text())["results"]["yaml_choice"]
    for metric in ("acc,none", "acc_norm,none"):
        assert yaml_results[metric] == stored["results"]["tiny_choice"][metric]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"query": "q", "choices": ["a", "b"], "gold": 2}\n')
    cases = {"gold = 2 is invalid": ["--hf", str(exported), "--tasks", str(bad)],
             "exactly one of --run-dir RUN and --hf DIR": ["--tasks", str(CHOICE)],
             "not a Hugging Face model directory": ["--hf", str(tmp_path), "--tasks", str(CHOICE)],
             "does not exist": ["--hf", str(exported), "--tasks", str(tmp_path / "missing.jsonl")],
             # a registry task whose dataset is on the Hub, neither cached nor reachable (offline)
             "arc_easy: a task's data could not be fetched": ["--hf", str(exported), "--tasks", "arc_easy"]}
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # read when they were imported
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    for message, argv in cases.items():
        capsys.readouterr()
        assert cli.main(["eval", *argv]) == 2, message
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and message in err[0], (message, err)


@pytest.mark.timeout(900)
def test_in_loop_tasks_equal_moetrain_eval_on_the_same_checkpoint(job_args, tmp_path, monkeypatch, capsys):
    from PIL import Image

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    run_dir = tmp_path / "run"
    argv = job_args(run_dir, train__steps=4, train__eval_every=2, checkpoint__every=2, train__eval_tasks=str(CHOICE))
    assert cli.main(["train", *argv]) == 0
    in_loop = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
               if r["kind"] == "tasks"}
    assert sorted(in_loop) == [2, 4]
    assert "tasks | tiny_choice/acc" in capsys.readouterr().err
    for step in (2, 4):
        results = evaluate(EvalOptions(run_dir=str(run_dir), step=step, tasks=str(CHOICE), batch_size=5))
        scores = summary(results)
        for metric in ("acc", "acc_norm"):
            assert scores[f"task/tiny_choice/{metric}"] == in_loop[step][f"task/tiny_choice/{metric}"]
        assert json.loads((run_dir / "eval" / f"step_{step:08d}.json").read_text())["results"]["tiny_choice"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "lm_eval"] == [2, 4]
    final = next(r for r in records if r["kind"] == "final")
    assert final["task/tiny_choice/acc"] == in_loop[4]["task/tiny_choice/acc"]
    out = tmp_path / "curve.png"
    assert cli.main(["plot", str(run_dir), "--out", str(out)]) == 0
    assert Image.open(out).size == (15 * 110, round(8.4 * 110))  # the task panel in rows of three panels
    bad = tmp_path / "text_only.jsonl"
    bad.write_text('{"text": "hello"}\n')
    assert cli.main(["train", *job_args(tmp_path / "run2", train__eval_tasks=str(bad))]) == 2
    assert "is a perplexity task; in-loop tasks are multiple choice" in capsys.readouterr().err


@pytest.mark.timeout(900)
def test_two_ranks_under_torchrun_give_the_one_rank_results(exported, tmp_path, monkeypatch):
    import os
    import shutil
    import signal
    import subprocess
    import sys

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not on PATH next to this interpreter")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tasks = f"{CHOICE},{TEXT}"
    one = summary(evaluate(EvalOptions(hf=str(exported), tasks=tasks, max_length=MAX_LENGTH, batch_size=2)))
    out = tmp_path / "two.json"
    command = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "moetrain", "eval", "--hf", str(exported),
               "--tasks", tasks, "--max_length", str(MAX_LENGTH), "--batch_size", "2", "--out", str(out)]
    proc = subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("torchrun moetrain eval did not finish within 600 s")
    assert proc.returncode == 0, stderr[-3000:]
    two = summary(json.loads(out.read_text()))
    assert two.keys() == one.keys()
    for key, value in one.items():
        assert two[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
