"""Mixtral, Qwen2-MoE and GPT-OSS in and out of Hugging Face, against transformers' own models (tiny, random).

Every parameter of the transformers model is redrawn (biases, sinks and norm weights included), so
a mis-mapped tensor shows in the logits. Import: logits equal transformers' on the same tokens
(float32, ≤ 1e-5 relative, max |diff| / max |logit|) in both RoPE layouts moetrain keeps; GPT-OSS
with sequences longer than its 5-token window and a clamp limit its pre-activations cross; packed
documents against transformers run on each document alone. Export after three optimizer steps (so
every tensor, biases and sinks included, has moved off the imported values): `from_pretrained`
loads it with no missing, unexpected or mismatched keys and computes the same logits.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors import safe_open

import hf_tiny
from moetrain.config.job import JobConfig
from moetrain.config.train import TrainConfig
from moetrain.errors import ConfigError
from moetrain.interop import export_family, hf_job_config, load_hf_weights, save_hf
from moetrain.model.transformer import Transformer
from moetrain.train.build import load_hf_model
from moetrain.train.loss import microbatch_loss, token_loss_sum
from moetrain.train.optim import build_optimizer

TOL = 1e-5
VARIANTS = {
    "mixtral": {},
    "mixtral-window-tied": {"sliding_window": 6, "tie_word_embeddings": True},
    "qwen2_moe": {},
    "qwen2_moe-dense0-norm": {"mlp_only_layers": [0], "norm_topk_prob": True},
    "gpt_oss": {},
    "gpt_oss-nobias-alltypes": {"attention_bias": False, "num_hidden_layers": 4,
                                "layer_types": ["full_attention", "sliding_attention", "sliding_attention",
                                                "full_attention"]},
    # YaRN as the released gpt-oss models ship it (scaled down: original context 16, factor 8, no truncation)
    "gpt_oss-yarn": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.5e5, "factor": 8.0, "beta_fast": 32.0,
                                         "beta_slow": 1.0, "original_max_position_embeddings": 16,
                                         "truncate": False}},
}


def family_of(variant: str) -> str:
    return variant.split("-")[0]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    out = {}
    for i, (variant, overrides) in enumerate(VARIANTS.items()):
        model = hf_tiny.build(family_of(variant), seed=10 + i, **overrides)
        out[variant] = (model, hf_tiny.save(model, tmp_path_factory.mktemp(variant)))
    return out


def tokens(seed: int = 0, shape=(2, 24)) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed))


def with_layout(cfg: JobConfig, directory, layout: str) -> Transformer:
    model = Transformer(dataclasses.replace(cfg.model, rope_layout=layout))
    load_hf_weights(model, directory)
    return model


def test_the_tiny_models_exercise_what_they_claim():
    gpt = hf_tiny.config("gpt_oss")
    assert gpt.sliding_window < 24 and "sliding_attention" in gpt.layer_types and "full_attention" in gpt.layer_types
    model = hf_tiny.build("gpt_oss")
    assert model.config._attn_implementation == "eager"  # the one with sinks
    h = model.model.layers[0].mlp.experts
    assert h.limit == 0.3
    x = torch.randn(64, 32)
    gate_up = x @ h.gate_up_proj[0] + h.gate_up_proj_bias[0]
    assert (gate_up[..., 0::2] > h.limit).any() and (gate_up[..., 1::2].abs() > h.limit).any()


@pytest.mark.parametrize("variant", VARIANTS)
def test_imported_logits_equal_transformers_in_both_rope_layouts(hf_dirs, variant):
    hf_model, directory = hf_dirs[variant]
    model, cfg = load_hf_model(directory)
    assert export_family(cfg.model) == family_of(variant)
    x = tokens()
    with torch.no_grad():
        want = hf_model(x).logits
        assert hf_tiny.relative_error(model(x), want) < TOL
        assert hf_tiny.relative_error(with_layout(cfg, directory, "interleaved")(x), want) < TOL


@pytest.mark.parametrize("variant", ["mixtral-window-tied", "qwen2_moe", "gpt_oss", "gpt_oss-nobias-alltypes"])
@pytest.mark.parametrize("attention", ["dense", "segments", "blocks", "auto"])
def test_packed_documents_equal_transformers_run_per_document(hf_dirs, variant, attention):
    hf_model, directory = hf_dirs[variant]
    model, cfg = load_hf_model(directory)
    model.cfg.attention = attention  # the plan is made per forward from cfg.attention
    lengths = [7, 1, 11, 5, 16]  # documents shorter and longer than the windows (5 and 6)
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).unsqueeze(0)
    x = tokens(seed=3, shape=(1, sum(lengths)))
    with torch.no_grad():
        packed = model(x, document_ids=document_ids)[0]
        start = 0
        for n in lengths:
            alone = hf_model(x[:, start:start + n]).logits[0]
            assert hf_tiny.relative_error(packed[start:start + n], alone) < TOL, (start, n)
            start += n


def train_three_steps(model: Transformer, seed: int = 7) -> None:
    optimizer = build_optimizer(model, TrainConfig(lr=1e-2, weight_decay=0.0))
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(3):
        x = torch.randint(0, 256, (2, 17), generator=gen)
        loss_sum, n_valid = token_loss_sum(model(x[:, :-1]), x[:, 1:])
        microbatch_loss(loss_sum, n_valid, n_valid, model.aux_loss()).backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


@pytest.mark.parametrize("variant", VARIANTS)
def test_export_after_training_loads_in_transformers_with_equal_logits(hf_dirs, variant, tmp_path):
    from transformers import AutoModelForCausalLM

    _, directory = hf_dirs[variant]
    cfg = hf_job_config(directory)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, rope_layout="interleaved", init_from=None))
    model = with_layout(cfg, directory, "interleaved")
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    train_three_steps(model)
    unmoved = [k for k, v in model.named_parameters() if torch.equal(v, before[k])]
    assert unmoved == []
    out = save_hf(model, cfg, tmp_path / "export")
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    x = tokens(seed=1)
    with torch.no_grad():
        assert hf_tiny.relative_error(model(x), loaded.float().eval()(x).logits) < TOL
    # and moetrain reads its own export back bit for bit
    again = with_layout(cfg, out, "interleaved")
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        if "expert_bias" not in name:
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def stored_names(directory) -> set[str]:
    names = set()
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as handle:
            names.update(handle.keys())
    return names


def test_on_disk_names_are_what_save_pretrained_writes(hf_dirs, tmp_path):
    """Mixtral keeps its released names on disk (block_sparse_moe.*), GPT-OSS its fused interleaved
    experts; moetrain's export writes exactly the names transformers' save_pretrained wrote."""
    for variant in ("mixtral", "qwen2_moe", "gpt_oss"):
        _, directory = hf_dirs[variant]
        cfg = hf_job_config(directory)
        model, _ = load_hf_model(directory)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init_from=None))
        out = save_hf(model, cfg, tmp_path / variant)
        assert stored_names(out) == stored_names(directory), variant
    assert "model.layers.0.block_sparse_moe.experts.0.w3.weight" in stored_names(hf_dirs["mixtral"][1])
    assert "model.layers.0.mlp.experts.gate_up_proj_bias" in stored_names(hf_dirs["gpt_oss"][1])


def edit_config(directory, tmp_path, **changes):
    copy = tmp_path / "edited"
    shutil.copytree(directory, copy)
    data = json.loads((copy / "config.json").read_text())
    data.update(changes)
    (copy / "config.json").write_text(json.dumps(data))
    return copy


@pytest.mark.parametrize("variant, changes, expected", [
    ("gpt_oss", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1.5e5}},
     "rope_type = 'dynamic'"),
    ("gpt_oss", {"layer_types": ["sliding_attention"]}, "layer_types = ['sliding_attention'] is not supported"),
    ("gpt_oss", {"sliding_window": None}, "sliding_window = None is not supported"),
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise = 0.1 is not supported"),
    ("qwen2_moe", {"use_sliding_window": True}, "use_sliding_window = True is not supported"),
    ("qwen2_moe", {"qkv_bias": False}, "qkv_bias = False is not supported"),
    ("qwen2_moe", {"shared_expert_intermediate_size": 21}, "config.json implies [21, 32]"),
])
def test_unsupported_or_inconsistent_directories_fail_in_one_line(hf_dirs, tmp_path, variant, changes, expected):
    _, directory = hf_dirs[variant]
    with pytest.raises(ConfigError) as err:
        load_hf_model(edit_config(directory, tmp_path, **changes))
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_what_a_family_cannot_hold_is_refused_for_export(hf_dirs):
    gpt = hf_job_config(hf_dirs["gpt_oss"][1]).model
    with pytest.raises(ConfigError, match="model.moe.activation = 'swiglu' cannot be exported.*clamped SwiGLU"):
        export_family(dataclasses.replace(gpt, moe=dataclasses.replace(gpt.moe, activation="swiglu")))
    qwen2 = hf_job_config(hf_dirs["qwen2_moe"][1]).model
    with pytest.raises(ConfigError, match="shared_expert_gate = False cannot be exported"):
        export_family(dataclasses.replace(qwen2, moe=dataclasses.replace(qwen2.moe, shared_expert_gate=False)))
    mixtral = hf_job_config(hf_dirs["mixtral"][1]).model
    with pytest.raises(ConfigError, match="model.moe.router_bias = True cannot be exported.*Mixtral's router"):
        export_family(dataclasses.replace(mixtral, moe=dataclasses.replace(mixtral.moe, router_bias=True)))
    qwen3_like = dataclasses.replace(mixtral, qk_norm="per_head", sliding_window=8)
    with pytest.raises(ConfigError, match="model.sliding_window = 8 cannot be exported.*no sliding window"):
        export_family(qwen3_like)
