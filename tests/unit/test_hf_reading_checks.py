"""Reading a Hugging Face directory: what the shared reader refuses in one line before building anything.

The reference is transformers' own tiny model saved as a directory (`hf_tiny`), then edited: a huge or
zero count in config.json, a FIFO as a weight file, weights stored as integers or float64.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

import hf_tiny
from moetrain.errors import ConfigError
from moetrain.train.build import load_hf_model


@pytest.fixture(scope="module", params=["qwen3_moe", "olmoe"])
def hf_dir(request, tmp_path_factory):
    model = hf_tiny.build_variant(request.param)
    return hf_tiny.save(model, tmp_path_factory.mktemp(request.param))


def _refused(directory, *expected: str) -> str:
    with pytest.raises(ConfigError) as err:
        load_hf_model(directory)
    text = str(err.value)
    assert "\n" not in text and all(e in text for e in expected), text
    return text


@pytest.mark.parametrize("changes, expected", [
    ({"decoder_sparse_step": 0}, "decoder_sparse_step = 0 is invalid"),
    ({"decoder_sparse_step": "2"}, "decoder_sparse_step = '2' is invalid"),
    ({"num_hidden_layers": 0}, "num_hidden_layers = 0 is invalid"),
    ({"num_hidden_layers": 2.5}, "num_hidden_layers = 2.5 is invalid"),
    ({"num_hidden_layers": True}, "num_hidden_layers = True is invalid"),
    ({"hidden_size": -32}, "hidden_size = -32 is invalid"),
    ({"num_experts": 10**15}, "num_experts = 1000000000000000 is invalid"),
    ({"mlp_only_layers": [0, 99]}, "mlp_only_layers = [0, 99] is invalid"),
])
def test_bad_counts_in_config_json_are_one_line(hf_dir, tmp_path, changes, expected):
    _refused(hf_tiny.edit_config(hf_dir, tmp_path, **changes), expected, "config.json")


def test_a_huge_num_hidden_layers_is_refused_at_once(hf_dir, tmp_path):
    directory = hf_tiny.edit_config(hf_dir, tmp_path, num_hidden_layers=10**12)
    code = (f"from moetrain.train.build import load_hf_model\n"
            f"from moetrain.errors import ConfigError\n"
            f"try:\n    load_hf_model({str(directory)!r})\nexcept ConfigError as err:\n    print(err)\n")
    start = time.perf_counter()
    try:  # a subprocess: the list over range(10**12) the bug builds would hold this test forever
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    except subprocess.TimeoutExpired:
        pytest.fail("num_hidden_layers = 10**12 was not refused within 120 s")
    assert "num_hidden_layers = 1000000000000 is invalid" in done.stdout, done.stdout + done.stderr
    assert time.perf_counter() - start < 120


def test_a_fifo_named_like_a_weight_file_is_refused_without_blocking(hf_dir, tmp_path):
    copy = tmp_path / "fifo"
    shutil.copytree(hf_dir, copy)
    os.mkfifo(copy / "extra.safetensors")
    code = (f"from moetrain.train.build import load_hf_model\nfrom moetrain.errors import ConfigError\n"
            f"try:\n    load_hf_model({str(copy)!r})\nexcept ConfigError as err:\n    print(err)\n")
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    except subprocess.TimeoutExpired:
        pytest.fail("a FIFO named extra.safetensors blocked the import")
    assert "extra.safetensors is not a regular file" in done.stdout, done.stdout + done.stderr


def _retyped(directory, tmp_path, dtype: torch.dtype):
    copy = tmp_path / str(dtype)
    shutil.copytree(directory, copy)
    (path,) = copy.glob("*.safetensors")
    state = load_file(str(path))
    name = sorted(state)[0]
    state[name] = (state[name] * 100).to(dtype)
    save_file(state, str(path))
    return copy, name


@pytest.mark.parametrize("dtype", [torch.int64, torch.int8, torch.bool])
def test_integer_weights_are_refused(hf_dir, tmp_path, dtype):
    directory, name = _retyped(hf_dir, tmp_path, dtype)
    _refused(directory, name, "not a floating-point type")


def test_float64_weights_load_with_one_warning(hf_dir, tmp_path, caplog):
    directory, name = _retyped(hf_dir, tmp_path, torch.float64)
    with caplog.at_level(logging.WARNING, logger="moetrain"):
        load_hf_model(directory)
    warned = [r.getMessage() for r in caplog.records if "float64" in r.getMessage()]
    assert len(warned) == 1 and name in warned[0], warned
