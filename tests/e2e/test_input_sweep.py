"""The input sweep (benchmarks/stress/input_sweep.py) over the commands that do not train: no case ends in a traceback.

The whole sweep (train included, ~400 cases) is the benchmark script; here the commands whose cases
take milliseconds to a second each: sample, plot, export-hf, data prepare, simulate, init-report.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from moetrain import cli
from moetrain.logging import setup_logging

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "stress" / "input_sweep.py"
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
FAST = ("sample", "plot", "export-hf", "data ", "simulate", "init-report", "unknown", "bench")


def test_no_input_of_the_fast_commands_ends_in_a_traceback(tmp_path):
    spec = importlib.util.spec_from_file_location("input_sweep", SCRIPT)
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    fixtures = sweep.build_fixtures(tmp_path)
    log_dir = tmp_path / "stderr"
    log_dir.mkdir()
    results = [(name, sweep.run_case(argv, 60.0, log_dir, i))
               for i, (name, argv) in enumerate(sweep.cases(fixtures)) if name.startswith(FAST)]
    assert len(results) > 100
    failed = [(name, r["outcome"], r["answer"]) for name, r in results if not r["ok"]]
    assert not failed, failed
    refused = [r for _, r in results if r["code"] == 2]
    assert [r["answer"] for r in refused if not r["answer"].startswith("moetrain: error:")] == []


# ---------------------------------------------------------------------------------------------------
# Bad inputs found by hand, one row each: (name, build(tmp) -> argv, what the one line must name). Each must
# end in exit 2 with one `moetrain: error:` line and leave nothing half-written (`out` absent or without a
# manifest). Add a row for every new one.


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _texts(tmp: Path, n: int = 30) -> Path:
    return _jsonl(tmp / "texts.jsonl", [{"text": f"document {i} " * 5} for i in range(n)])


def _oov_shards(tmp: Path) -> list[str]:
    """Prepared shards whose ids reach past the byte tokenizer's 259, checksums and manifest made consistent."""
    out = tmp / "shards"
    assert cli.main(["data", "prepare", "--input", str(_texts(tmp)), "--out", str(out), "--quiet"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    entry = manifest["splits"]["train"][0]
    tokens_path = out / entry["files"]["tokens"]
    tokens = np.load(tokens_path)
    tokens[5] = 300
    np.save(tokens_path, tokens)
    entry["sha256"]["tokens"] = hashlib.sha256(tokens_path.read_bytes()).hexdigest()
    (out / "train" / "shard_00000.json").write_text(json.dumps(entry))
    (out / "manifest.json").write_text(json.dumps(manifest))
    run = tmp / "run"
    return ["train", "--config", str(CONFIGS / "tiny_moe.toml"), "--data.source", "tokens", "--data.path", str(out),
            "--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "2", "--model.ffn_hidden", "32",
            "--model.moe.n_experts", "4", "--model.moe.expert_hidden", "16", "--data.seq_len", "32",
            "--train.steps", "2", "--train.warmup_steps", "1", "--train.eval_every", "0", "--train.sample_tokens", "0",
            "--train.num_threads", "1",
            "--logging.run_dir", str(run), "--logging.progress_bar", "False"]


def _hf_dir(tmp: Path, **changes) -> Path:
    import hf_tiny

    directory = tmp / "hf"
    directory.mkdir()
    config = hf_tiny.config("deepseek_v3").to_dict()
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _raw_config(tmp: Path, text: str) -> Path:
    directory = tmp / "hf"
    directory.mkdir()
    (directory / "config.json").write_text(text)
    return directory


def _parquet(tmp: Path, values: list, name: str = "rows.parquet") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp / name
    pq.write_table(pa.table({"text": values}), path)
    return path


def _corrupt_parquet(tmp: Path) -> Path:
    path = _parquet(tmp, [f"document {i} " * 40 for i in range(200)])
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle: middle + 64] = bytes(64)
    path.write_bytes(bytes(data))
    return path


def _two_shards_same_tensor(tmp: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    directory = _hf_dir(tmp)
    tensor = {"model.embed_tokens.weight": torch.zeros(4, 4)}
    save_file(tensor, str(directory / "model-00001-of-00002.safetensors"))
    save_file(tensor, str(directory / "model-00002-of-00002.safetensors"))
    return directory


def _prepare(source: Path, tmp: Path, *extra: str) -> list[str]:
    return ["data", "prepare", "--input", str(source), "--out", str(tmp / "out"), "--quiet", *extra]


BAD_INPUTS = [
    ("train: out-of-vocabulary ids in consistent token shards", _oov_shards, "holds token id 300"),
    ("config --from-hf: Infinity in a size field",
     lambda t: ["config", "--from-hf", str(_raw_config(t, '{"model_type": "deepseek_v3", "hidden_size": Infinity}'))],
     "Infinity"),
    ("config --from-hf: 100,000 nested [ in config.json",
     lambda t: ["config", "--from-hf", str(_raw_config(t, "[" * 100_000))], "nested too deeply"),
    ("config --from-hf: n_group 2.5", lambda t: ["config", "--from-hf", str(_hf_dir(t, n_group=2.5))], "n_group"),
    ("data prepare --streaming: a truncated JSON Lines file",
     lambda t: _prepare(_truncated(t), t, "--streaming"), "texts.jsonl"),
    ("data prepare: a Parquet text column of integers", lambda t: _prepare(_parquet(t, list(range(20))), t),
     "rows.parquet"),
    ("data prepare: a JSON Lines row whose text is not a string",
     lambda t: _prepare(_jsonl(t / "mixed.jsonl", [{"text": "fine"}, {"text": 7}, {"text": "also fine"}]), t),
     "mixed.jsonl:2 is not"),
    ("data prepare: every record skipped",
     lambda t: _prepare(_jsonl(t / "chats.jsonl", [{"messages": []}] * 3), t, "--format", "chat", "--tokenizer",
                        str(_chat_tokenizer(t)), "--skip-bad-files"), "skipped every record (3"),
    ("data prepare: a corrupted Parquet column chunk", lambda t: _prepare(_corrupt_parquet(t), t), "rows.parquet"),
    ("train --model.init_from: a tensor in two shards without an index",
     lambda t: ["train", "--model.init_from", f"hf:{_two_shards_same_tensor(t)}", "--logging.run_dir", str(t / "run"),
                "--train.steps", "1", "--train.warmup_steps", "0", "--data.seq_len", "16"],
     "tensor model.embed_tokens.weight is in both"),
    ("sample: one unknown option beside a dashed valid one",
     lambda t: ["sample", "--run-dir", str(t), "--bogus", "1"], "unknown option --bogus ("),
]


def _truncated(tmp: Path) -> Path:
    path = _texts(tmp, 50)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 17])  # the last record cut in the middle of its string
    return path


def _chat_tokenizer(tmp: Path) -> Path:
    from chat_fixtures import TEMPLATES, tokenizer_dir

    return tokenizer_dir(tmp / "tok", TEMPLATES["qwen_chatml"])


@pytest.mark.parametrize("case", [row[0] for row in BAD_INPUTS])
def test_a_bad_input_is_one_line_exit_2_and_nothing_half_written(case, tmp_path, capsys):
    _, build, named = next(row for row in BAD_INPUTS if row[0] == case)
    argv = build(tmp_path)
    capsys.readouterr()
    setup_logging()  # log lines to this test's stderr (a run of an earlier test left its own, now closed)
    code = cli.main(argv)
    # (log lines and the datasets library's own progress lines are not answers)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "WARNING" not in line
           and " INFO " not in line and not line.startswith("Generating ")]
    assert code == 2 and len(err) == 1 and err[0].startswith("moetrain: error:") and named in err[0], (code, err)
    assert not (tmp_path / "out" / "manifest.json").exists()
