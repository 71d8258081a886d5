"""Multi-token-prediction layers of DeepSeek-V3 and GLM-4.5 directories: read into the model, written back unchanged.

transformers builds no MTP module, so a directory that holds one is made here the way the released checkpoints
lay it out: a 4-layer tiny model's last decoder layer becomes `model.layers.3` of a 3-layer model with
num_nextn_predict_layers = 1, joined by random enorm, hnorm, eh_proj and shared_head.norm and by copies of
the embedding and head. That the block maps like a main block is checked against the same layer imported as a
main block (whose logits tests/unit/test_hf_families.py checks against transformers).
"""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import hf_tiny
from moetrain.config.model import ModelConfig
from moetrain.data.tokenizer import write_byte_level_tokenizer
from moetrain.errors import ConfigError
from moetrain.interop import hf_job_config, save_hf
from moetrain.interop.config_map import export_family
from moetrain.train.build import build_model, load_hf_model

FAMILIES = {"deepseek_v3": 21, "glm4_moe": 22}  # family -> seed


def write_mtp_directory(family: str, tmp_path, seed: int):
    """(directory with one MTP layer, directory of the 4-layer model its block came from)."""
    four = hf_tiny.save(hf_tiny.build(family, seed=seed, num_hidden_layers=4), tmp_path / "four")
    state = load_file(str(four / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    dim = hf_tiny.config(family).hidden_size
    state.update({"model.layers.3.enorm.weight": 1 + 0.3 * torch.randn(dim, generator=gen),
                  "model.layers.3.hnorm.weight": 1 + 0.3 * torch.randn(dim, generator=gen),
                  "model.layers.3.eh_proj.weight": 0.1 * torch.randn(dim, 2 * dim, generator=gen),
                  "model.layers.3.shared_head.norm.weight": 1 + 0.3 * torch.randn(dim, generator=gen),
                  "model.layers.3.embed_tokens.weight": state["model.embed_tokens.weight"].clone(),
                  "model.layers.3.shared_head.head.weight": state["lm_head.weight"].clone()})
    out = tmp_path / "mtp"
    hf_tiny.config(family, num_nextn_predict_layers=1).save_pretrained(out)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_byte_level_tokenizer(out / "tokenizer.json")
    return out, four


@pytest.fixture(scope="module", params=list(FAMILIES))
def mtp_dir(request, tmp_path_factory):
    family = request.param
    return (family, *write_mtp_directory(family, tmp_path_factory.mktemp(family), FAMILIES[family]))


def stored(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as handle:
            tensors.update((name, handle.get_tensor(name)) for name in handle.keys())
    return tensors


def test_import_then_export_is_byte_identical_and_maps_the_mtp_block_like_a_main_block(mtp_dir, tmp_path):
    family, directory, four = mtp_dir
    model, cfg = load_hf_model(directory)
    assert cfg.model.mtp_depth == 1
    original = stored(directory)
    # The module's own tensors, and its block exactly as the same layer imported as block 3 of the 4-layer model.
    module = model.mtp[0]
    for ours, theirs in (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"), ("norm", "shared_head.norm")):
        assert torch.equal(getattr(module, ours).weight, original[f"model.layers.3.{theirs}.weight"])
    as_main, _ = load_hf_model(four)
    block = dict(module.block.state_dict())
    assert block.keys() == as_main.layers[3].state_dict().keys()
    assert all(torch.equal(block[name], tensor) for name, tensor in as_main.layers[3].state_dict().items())
    out = save_hf(model, cfg, tmp_path / "out")
    exported = stored(out)
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and exported[name].shape == tensor.shape, name
        assert exported[name].view(torch.uint8).equal(tensor.view(torch.uint8)), name
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1


def test_the_export_loads_in_transformers_with_only_its_mtp_tensors_unexpected(mtp_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    family, directory, _ = mtp_dir
    model, cfg = load_hf_model(directory)
    out = save_hf(model, cfg, tmp_path / "out")
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert info["missing_keys"] == set() and info["mismatched_keys"] == set()
    # transformers computes no MTP layer: what it reports are the MTP layer's tensors (experts under the fused
    # names it converts them to), and nothing else.
    mtp_names = {name for name in stored(out) if name.startswith("model.layers.3.") and ".experts." not in name}
    unexpected = set(info["unexpected_keys"])
    assert mtp_names <= unexpected and all(name.startswith("model.layers.3.") for name in unexpected)
    x = hf_tiny.tokens(seed=5)
    with torch.no_grad():
        assert hf_tiny.relative_error(model(x), loaded.float().eval()(x).logits) < 1e-5


def test_a_job_with_fewer_mtp_layers_skips_the_deeper_ones_with_one_warning(mtp_dir, caplog):
    _, directory, _ = mtp_dir
    cfg = hf_job_config(directory)
    with_mtp = build_model(cfg.model, weights=f"hf:{directory}")
    with caplog.at_level(logging.WARNING, logger="moetrain"):
        without = build_model(dataclasses.replace(cfg.model, mtp_depth=0), weights=f"hf:{directory}")
    warnings = [r.getMessage() for r in caplog.records if "not read" in r.getMessage()]
    assert len(warnings) == 1 and "model.layers.3." in warnings[0] and "model.mtp_depth = 0" in warnings[0]
    x = hf_tiny.tokens(seed=6)
    with torch.no_grad():
        assert torch.equal(with_mtp(x), without(x))
    with pytest.raises(ConfigError, match="model.mtp_depth = 2 but num_nextn_predict_layers gives 1"):
        build_model(dataclasses.replace(cfg.model, mtp_depth=2), weights=f"hf:{directory}")


def test_unsupported_mtp_directories_fail_in_one_line(mtp_dir, tmp_path):
    family, directory, four = mtp_dir
    # An MTP layer with an embedding of its own: moetrain shares the main one.
    own = tmp_path / "own"
    own.mkdir()
    for path in directory.iterdir():
        (own / path.name).write_bytes(path.read_bytes())
    state = load_file(str(own / "model.safetensors"))
    state["model.layers.3.embed_tokens.weight"] = state["model.layers.3.embed_tokens.weight"] + 1
    save_file(state, str(own / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="model.layers.3.embed_tokens.weight differs") as err:
        load_hf_model(own)
    assert "\n" not in str(err.value)
    # config.json promises an MTP layer its files lack (what transformers' save_pretrained writes).
    promised = hf_tiny.edit_config(four, tmp_path, num_hidden_layers=3, num_nextn_predict_layers=1)
    state = {k: v for k, v in load_file(str(promised / "model.safetensors")).items()
             if not k.startswith("model.layers.3.")}
    save_file(state, str(promised / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="missing.*--model.mtp_depth 0"):
        load_hf_model(promised)


def test_families_without_mtp_layers_refuse_to_export_them():
    cfg = ModelConfig(vocab_size=300, dim=32, n_layers=2, n_heads=4, mtp_depth=1)
    with pytest.raises(ConfigError, match="model.mtp_depth = 1 .*has no multi-token-prediction layers"):
        export_family(cfg)
