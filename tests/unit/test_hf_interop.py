"""Hugging Face import/export against transformers' own Qwen3-MoE and OLMoE models (tiny, random, float32).

Logits of the imported model must equal transformers' on the same tokens to 1e-5 relative
(max |diff| / max |logit|), in both RoPE layouts moetrain can keep, and with packed documents
against transformers run on each document alone; what moetrain writes must load with
`from_pretrained` without missing or unexpected keys and give the same logits. Every bad
directory gives a one-line ConfigError naming what is wrong.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import hf_tiny
from moetrain.config.job import JobConfig
from moetrain.errors import ConfigError
from moetrain.interop import check_architecture, export_family, hf_job_config, load_hf_weights, save_hf
from moetrain.model.transformer import Transformer
from moetrain.train.build import load_hf_model

TOL = 1e-5
VARIANTS = {
    "qwen3_moe": {},
    "qwen3_moe-dense0-tied-nonorm": {"mlp_only_layers": [0], "tie_word_embeddings": True, "norm_topk_prob": False},
    "olmoe": {},
    "olmoe-clip-norm": {"clip_qkv": 0.3, "norm_topk_prob": True},
}


def family_of(variant: str) -> str:
    return variant.split("-")[0]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """variant -> (transformers model, saved directory)."""
    out = {}
    for i, (variant, overrides) in enumerate(VARIANTS.items()):
        model = hf_tiny.build(family_of(variant), seed=i, **overrides)
        out[variant] = (model, hf_tiny.save(model, tmp_path_factory.mktemp(variant)))
    return out


def tokens(seed: int = 0, shape=(2, 24)) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed))


def interleaved_copy(cfg: JobConfig, directory) -> Transformer:
    """The same directory imported into moetrain's interleaved RoPE layout (q/k rows permuted)."""
    model = Transformer(dataclasses.replace(cfg.model, rope_layout="interleaved"))
    load_hf_weights(model, directory)
    return model


@pytest.mark.parametrize("variant", VARIANTS)
def test_imported_logits_equal_transformers_in_both_rope_layouts(hf_dirs, variant):
    hf_model, directory = hf_dirs[variant]
    model, cfg = load_hf_model(directory)
    assert cfg.model.rope_layout == "half" and cfg.data.tokenizer == str(directory)
    x = tokens()
    with torch.no_grad():
        want = hf_model(x).logits
        got_half = model(x)
        got_interleaved = interleaved_copy(cfg, directory)(x)
    assert hf_tiny.relative_error(got_half, want) < TOL
    assert hf_tiny.relative_error(got_interleaved, want) < TOL


@pytest.mark.parametrize("variant", ["qwen3_moe", "olmoe"])
def test_packed_documents_equal_transformers_run_per_document(hf_dirs, variant):
    hf_model, directory = hf_dirs[variant]
    model, _ = load_hf_model(directory)
    lengths = [7, 1, 11, 5]
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).unsqueeze(0)
    x = tokens(seed=3, shape=(1, sum(lengths)))
    with torch.no_grad():
        packed = model(x, document_ids=document_ids)[0]
        start = 0
        for n in lengths:
            alone = hf_model(x[:, start:start + n]).logits[0]
            assert hf_tiny.relative_error(packed[start:start + n], alone) < TOL
            start += n


def test_fused_expert_layout_loads_like_the_per_expert_layout(hf_dirs, tmp_path):
    # transformers 5 holds experts fused in memory (gate_up_proj [E, 2n, d]) and from_pretrained
    # accepts that layout on disk too, so moetrain reads it as well.
    hf_model, directory = hf_dirs["qwen3_moe"]
    fused = tmp_path / "fused"
    fused.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copyfile(directory / name, fused / name)
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(fused / "model.safetensors"), metadata={"format": "pt"})
    model, _ = load_hf_model(fused)
    reference, _ = load_hf_model(directory)
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("variant", VARIANTS)
def test_export_loads_in_transformers_with_no_missing_or_unexpected_keys(hf_dirs, variant, tmp_path):
    from transformers import AutoModelForCausalLM

    _, directory = hf_dirs[variant]
    cfg = hf_job_config(directory)
    model = interleaved_copy(cfg, directory)
    with torch.no_grad():  # move away from the imported weights so the test sees what was written
        for param in model.parameters():
            param.add_(0.01 * torch.randn(param.shape, generator=torch.Generator().manual_seed(5)))
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, rope_layout="interleaved", init_from=None))
    out = save_hf(model, cfg, tmp_path / "export")
    stored = load_file(str(next(out.glob("*.safetensors"))))
    assert "model.layers.1.mlp.experts.5.gate_proj.weight" in stored  # per-expert, as save_pretrained writes
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    x = tokens(seed=1)
    with torch.no_grad():
        assert hf_tiny.relative_error(model(x), loaded.float()(x).logits) < TOL
    assert (out / "tokenizer.json").read_bytes() == (directory / "tokenizer.json").read_bytes()


def test_architecture_mismatch_is_one_line_naming_each_field(hf_dirs):
    _, directory = hf_dirs["qwen3_moe"]
    cfg = hf_job_config(directory)
    wrong = dataclasses.replace(cfg.model, dim=64, moe=dataclasses.replace(cfg.model.moe, top_k=3))
    with pytest.raises(ConfigError) as err:
        check_architecture(wrong, directory)
    message = str(err.value)
    assert "\n" not in message
    assert "model.dim = 64 but hidden_size gives 32" in message
    assert "model.moe.top_k = 3 but num_experts_per_tok gives 2" in message
    check_architecture(dataclasses.replace(cfg.model, rope_layout="interleaved", max_seq_len=16), directory)


def edit_config(directory, tmp_path, **changes):
    copy = tmp_path / "edited"
    shutil.copytree(directory, copy)
    data = json.loads((copy / "config.json").read_text())
    data.update(changes)
    (copy / "config.json").write_text(json.dumps(data))
    return copy


@pytest.mark.parametrize("changes, expected", [
    ({"model_type": "llama"}, "model_type = 'llama' is not a supported family"),
    ({"use_sliding_window": True}, "use_sliding_window = True is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_type = 'yarn'"),
    ({"attention_bias": True}, "attention_bias = True is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act = 'gelu' is not supported"),
    ({"mlp_only_layers": [1]}, "dense layers must be the first ones"),
    ({"num_experts": 8}, "tensor model.layers.0.mlp.experts.6.gate_proj.weight is missing"),
    ({"moe_intermediate_size": 9}, "has shape [8, 32], config.json implies [9, 32]"),
])
def test_unsupported_or_inconsistent_directories_fail_in_one_line(hf_dirs, tmp_path, changes, expected):
    _, directory = hf_dirs["qwen3_moe"]
    with pytest.raises(ConfigError) as err:
        load_hf_model(edit_config(directory, tmp_path, **changes))
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_missing_files_are_named(hf_dirs, tmp_path):
    _, directory = hf_dirs["olmoe"]
    with pytest.raises(ConfigError, match="does not exist"):
        load_hf_model(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="config.json is missing"):
        load_hf_model(empty)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copyfile(directory / "config.json", pickled / "config.json")
    (pickled / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ConfigError, match="pickle files are never loaded"):
        load_hf_model(pickled)
    indexed = tmp_path / "indexed"
    shutil.copytree(directory, indexed)
    (indexed / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "model-2.safetensors"}}))
    with pytest.raises(ConfigError, match="lists model-2.safetensors, which is missing"):
        load_hf_model(indexed)
    partial = tmp_path / "partial"
    shutil.copytree(directory, partial)
    state = load_file(str(partial / "model.safetensors"))
    del state["model.layers.1.self_attn.k_norm.weight"]
    state["model.layers.1.self_attn.extra.bias"] = torch.zeros(3)
    save_file(state, str(partial / "model.safetensors"))
    with pytest.raises(ConfigError, match="tensor model.layers.1.self_attn.k_norm.weight is missing"):
        load_hf_model(partial)


def test_models_outside_both_families_are_refused_for_export():
    cfg = JobConfig().model  # tiny_moe-like defaults: no QK-norm (Mixtral's kind), but a dense first layer
    with pytest.raises(ConfigError, match="model.n_dense_layers = 1 cannot be exported.*Mixtral has every layer MoE"):
        export_family(cfg)
    assert export_family(dataclasses.replace(cfg, n_dense_layers=0)) == "mixtral"
    with pytest.raises(ConfigError, match="model.attention_sinks = True cannot be exported.*OLMoE has no attention"):
        export_family(dataclasses.replace(cfg, qk_norm="full", attention_sinks=True))
    olmoe_dense = dataclasses.replace(cfg, qk_norm="full", n_dense_layers=1)
    with pytest.raises(ConfigError, match="OLMoE has every layer MoE"):
        export_family(olmoe_dense)
    qwen_aux_free = dataclasses.replace(cfg, qk_norm="per_head",
                                        moe=dataclasses.replace(cfg.moe, load_balance="aux_free"))
    with pytest.raises(ConfigError, match="load_balance = 'aux_free'"):
        export_family(qwen_aux_free)
    assert export_family(dataclasses.replace(cfg, qk_norm="per_head")) == "qwen3_moe"
