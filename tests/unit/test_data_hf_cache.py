"""`data prepare --input hf:NAME`: a dataset in the local Hugging Face cache, by name, offline.

The cache is populated for real, in a temporary HF_HOME: `datasets.load_dataset(DIR)` on a local
dataset directory writes it under the directory's name (`NAME/default/0.0.0/HASH/`, Arrow files and
dataset_info.json), as a download from the Hub writes `NAMESPACE___NAME/...`; the directory is then
removed, so only the cache can answer. The CLI runs in child processes with that HF_HOME (the
`datasets` configuration is read at import). The reference: the same rows prepared from a local file.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_data_streaming import conversations

from chat_fixtures import TEMPLATES, tokenizer_dir

datasets = pytest.importorskip("datasets")

SRC = str(Path(__file__).resolve().parents[2] / "src")


def run(args: list[str], home: Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HOME": str(home), "HF_DATASETS_CACHE": str(home / "datasets"),
           "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("HF_HUB_OFFLINE", None)  # prepare makes itself offline for hf: inputs
    env.pop("HF_DATASETS_OFFLINE", None)
    return subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=300)


def shard_files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*.npy"))}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """(HF_HOME holding the dataset 'tiny_chats', a parquet file of the same rows, a tokenizer directory)."""
    root = tmp_path_factory.mktemp("hf_cache")
    rows = [{"messages": c} for c in conversations(40, 11)]
    reference = root / "reference.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(reference))
    local = root / "tiny_chats"
    local.mkdir()
    shutil.copy(reference, local / "train.parquet")
    code = f"import datasets; print(datasets.load_dataset({str(local)!r}))"
    done = run(["-c", code], root / "home", root)
    assert done.returncode == 0, done.stderr
    shutil.rmtree(local)  # only the cache holds it now
    assert (root / "home" / "datasets" / "tiny_chats").is_dir()
    return root / "home", reference, tokenizer_dir(root / "tok", TEMPLATES["qwen_chatml"])


# One child process runs several `moetrain` command lines (each import of torch costs seconds on a shared
# machine): for each, its exit status and what it wrote to stderr, as JSON on stdout.
CLI_RUNS = """
import contextlib, io, json, sys
from moetrain import cli
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = cli.main(argv)
    results.append([status, err.getvalue()])
print(json.dumps(results))
"""


def run_cli(argvs: list[list[str]], home: Path, cwd: Path) -> list[tuple[int, str]]:
    done = run(["-c", CLI_RUNS, json.dumps(argvs)], home, cwd)
    assert done.returncode == 0, done.stderr
    return [tuple(r) for r in json.loads(done.stdout.strip().splitlines()[-1])]


def test_a_cached_dataset_prepares_offline_like_the_same_rows_from_a_file(cache, tmp_path):
    home, reference, tok = cache
    common = ["--tokenizer", str(tok), "--format", "chat", "--quiet", "--heldout-fraction", "0.1"]
    outs = {name: tmp_path / name for name in ("cached", "cached_streaming", "file")}
    results = run_cli([
        ["data", "prepare", "--input", "hf:tiny_chats", "--out", str(outs["cached"]), *common],
        ["data", "prepare", "--input", "hf:tiny_chats", "--out", str(outs["cached_streaming"]), *common,
         "--streaming"],
        ["data", "prepare", "--input", str(reference), "--out", str(outs["file"]), *common],
    ], home, tmp_path)
    assert all(status == 0 for status, _ in results), results
    direct = shard_files(outs["file"])
    assert any(name.endswith(".mask.npy") for name in direct)
    for name in ("cached", "cached_streaming"):
        assert shard_files(outs[name]) == direct
        manifest = json.loads((outs[name] / "manifest.json").read_text())
        assert manifest["inputs"] == ["hf:tiny_chats"]
        assert manifest["train_documents"] + manifest["heldout_documents"] == 40


CASES = [
    (["--input", "hf:not_in_the_cache"], "dataset 'not_in_the_cache' is not in the local Hugging Face cache"),
    (["--input", "hf:tiny_chats", "--hf-split", "validation"], "--hf-split 'validation': dataset 'tiny_chats' "
                                                                 "cannot be read from the local Hugging Face cache"),
    (["--input", "hf:tiny_chats", "--hf-config", "other"], "dataset 'tiny_chats' cannot be read"),
    (["--input", "hf:tiny_chats", "--messages-field", "conversation"], "'conversation' is not a column"),
    (["--input", "hf:"], "no dataset name given"),
]


def test_what_the_cache_cannot_answer_is_one_line_naming_the_dataset(cache, tmp_path):
    home, _, tok = cache
    argvs = [["data", "prepare", *options, "--out", str(tmp_path / f"out{i}"), "--tokenizer", str(tok),
              "--format", "chat", "--quiet"] for i, (options, _) in enumerate(CASES)]
    for i, ((status, stderr), (_, needle)) in enumerate(zip(run_cli(argvs, home, tmp_path), CASES)):
        errors = [line for line in stderr.splitlines() if line.startswith("moetrain: error:")]
        assert status == 2 and len(errors) == 1 and needle in errors[0], stderr
        assert "Traceback" not in stderr and not (tmp_path / f"out{i}" / "manifest.json").exists()
