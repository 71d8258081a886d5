"""DeepSeek-V3 and GLM-4.5 import/export against transformers' own models (tiny, random, float32).

Every parameter and the correction-bias buffer of the transformers model is redrawn (hf_tiny), so a
mis-mapped tensor shows in the logits. The DeepSeek-V3 variants cover the low-rank query path and a
full query projection, both rope_interleave layouts, YaRN with both mscales, group-limited routing
(n_group 4, topk_group 2), routed_scaling_factor 2.5, a shared expert and a dense first layer;
GLM-4.5 covers q/k/v biases, per-head QK-norm and partial rotary. Logits must equal transformers'
to 1e-5 relative (max |diff| / max |logit|), with packed documents against transformers run on
each document alone; an export after 3 training steps (aux-free bias updates included) loads with
`from_pretrained` without missing or unexpected keys and gives moetrain's logits.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import hf_tiny
from moetrain.config.job import JobConfig
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.errors import ConfigError
from moetrain.interop import export_family, hf_job_config, load_hf_weights, save_hf
from moetrain.model.transformer import Transformer
from moetrain.train.build import load_hf_model

TOL = 1e-5
YARN = {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "mscale": 0.9, "mscale_all_dim": 1.0, "beta_fast": 16.0, "beta_slow": 2.0}
VARIANTS = {
    "deepseek_v3": {},
    "deepseek_v3-fullq-half": {"q_lora_rank": None, "rope_interleave": False},
    "deepseek_v3-yarn-nonorm": {"rope_parameters": YARN, "norm_topk_prob": False},
    "deepseek_v3-widev-ungrouped": {"v_head_dim": 16, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0,
                                    "tie_word_embeddings": True, "n_shared_experts": 2},
    "glm4_moe": {},
    "glm4_moe-fullrotary-nobias": {"rope_parameters": {"rope_type": "default", "rope_theta": 1000.0,
                                                       "partial_rotary_factor": 1.0},
                                   "attention_bias": False, "use_qk_norm": False},
    "glm4_moe-fullrotary-bias": {"rope_parameters": {"rope_type": "default", "rope_theta": 1000.0,
                                                     "partial_rotary_factor": 1.0}},
}


def family_of(variant: str) -> str:
    return variant.split("-")[0]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """variant -> (transformers model, saved directory)."""
    out = {}
    for i, (variant, overrides) in enumerate(VARIANTS.items()):
        if "yarn" in variant:
            overrides = {**overrides, "max_position_embeddings": 128}
        model = hf_tiny.build(family_of(variant), seed=10 + i, **overrides)
        out[variant] = (model, hf_tiny.save(model, tmp_path_factory.mktemp(variant)))
    return out


def tokens(seed: int = 0, shape=(2, 24)) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", VARIANTS)
def test_imported_logits_equal_transformers(hf_dirs, variant):
    hf_model, directory = hf_dirs[variant]
    model, cfg = load_hf_model(directory)
    want_layout = "half" if variant in ("deepseek_v3-fullq-half",) or variant.startswith("glm4_moe") else "interleaved"
    assert cfg.model.rope_layout == want_layout
    x = tokens()
    with torch.no_grad():
        assert hf_tiny.relative_error(model(x), hf_model(x).logits) < TOL
    if variant.startswith("glm4_moe-fullrotary"):  # full rotary: the interleaved layout (q/k rows and biases permuted)
        interleaved = Transformer(dataclasses.replace(cfg.model, rope_layout="interleaved"))
        load_hf_weights(interleaved, directory)
        with torch.no_grad():
            assert hf_tiny.relative_error(interleaved(x), hf_model(x).logits) < TOL


def test_imported_model_has_the_shapes_of_the_variant(hf_dirs):
    hf_model, directory = hf_dirs["deepseek_v3"]
    model, cfg = load_hf_model(directory)
    m = cfg.model
    assert (m.kv_lora_rank, m.q_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (16, 12, 8, 4, 6)
    assert (m.n_dense_layers, m.moe.n_group, m.moe.topk_group, m.moe.routed_scaling_factor) == (1, 4, 2, 2.5)
    assert (m.moe.score_func, m.moe.load_balance, m.moe.n_shared_experts) == ("sigmoid", "aux_free", 1)
    # The correction bias is moetrain's expert_bias, and it changes the logits (so a lost bias would show).
    want_bias = hf_model.model.layers[2].mlp.gate.e_score_correction_bias
    assert torch.equal(model.layers[2].moe.expert_bias, want_bias) and want_bias.abs().min() > 0
    x = tokens()
    with torch.no_grad():
        before = model(x)
        for moe in model.moe_layers():
            moe.expert_bias.zero_()
        assert hf_tiny.relative_error(model(x), before) > 1e-3


@pytest.mark.parametrize("variant", ["deepseek_v3", "deepseek_v3-widev-ungrouped", "glm4_moe"])
@pytest.mark.parametrize("method", ["dense", "segments", "blocks", "flex"])
def test_packed_documents_equal_transformers_run_per_document(hf_dirs, variant, method):
    hf_model, directory = hf_dirs[variant]
    cfg = hf_job_config(directory)
    model = Transformer(dataclasses.replace(cfg.model, attention=method))
    load_hf_weights(model, directory)
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
    hf_model, directory = hf_dirs["deepseek_v3"]
    fused = tmp_path / "fused"
    fused.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copyfile(directory / name, fused / name)
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state
    save_file(state, str(fused / "model.safetensors"), metadata={"format": "pt"})
    model, _ = load_hf_model(fused)
    reference, _ = load_hf_model(directory)
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def train_steps(model: Transformer, steps: int = 3) -> None:
    """A few AdamW steps on the LM loss, with the aux-free bias update after each (what the trainer does)."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        x = tokens(seed=20 + step, shape=(2, 16))
        loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        model.update_expert_bias()
    model.eval()


@pytest.mark.parametrize("variant", ["deepseek_v3", "deepseek_v3-fullq-half", "deepseek_v3-yarn-nonorm",
                                     "deepseek_v3-widev-ungrouped", "glm4_moe", "glm4_moe-fullrotary-bias"])
def test_export_after_training_loads_in_transformers_with_equal_logits(hf_dirs, variant, tmp_path):
    from transformers import AutoModelForCausalLM

    hf_model, directory = hf_dirs[variant]
    model, cfg = load_hf_model(directory)
    bias_before = model.moe_layers()[0].expert_bias.clone()
    train_steps(model)
    assert not torch.equal(model.moe_layers()[0].expert_bias, bias_before)  # the aux-free update moved it
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init_from=None))
    out = save_hf(model, cfg, tmp_path / "export")
    stored = load_file(str(next(out.glob("*.safetensors"))))
    last = cfg.model.n_layers - 1
    assert f"model.layers.{last}.mlp.experts.7.gate_proj.weight" in stored  # per-expert, as save_pretrained writes
    assert torch.equal(stored[f"model.layers.{last}.mlp.gate.e_score_correction_bias"],
                       model.layers[last].moe.expert_bias)
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    assert type(loaded).__name__ == type(hf_model).__name__
    x = tokens(seed=1)
    with torch.no_grad():
        ours = model(x)
        assert hf_tiny.relative_error(ours, loaded.float()(x).logits) < TOL
        assert hf_tiny.relative_error(ours, hf_model(x).logits) > 1e-4  # training changed the model
    # And back: the export imports to the same model.
    again, _ = load_hf_model(out)
    with torch.no_grad():
        assert hf_tiny.relative_error(again(x), ours) < TOL


@pytest.mark.parametrize("attention", ["mla", "gqa"])
def test_a_moetrain_model_with_sigmoid_routing_shared_experts_and_aux_free_exports(tmp_path, attention):
    """Built in moetrain (interleaved RoPE, its own init), not imported: exports as DeepSeek-V3 (MLA) or GLM-4.5."""
    from transformers import AutoModelForCausalLM

    mla = dict(kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    cfg = JobConfig()
    cfg.model = ModelConfig(dim=32, n_layers=2, n_heads=4, ffn_hidden=48, n_dense_layers=1, max_seq_len=64,
                            attention_bias="qkv" if attention == "gqa" else "none",
                            **(mla if attention == "mla" else {}),
                            moe=MoEConfig(n_experts=8, top_k=2, expert_hidden=8, n_shared_experts=1,
                                          score_func="sigmoid", load_balance="aux_free", n_group=2, topk_group=1,
                                          routed_scaling_factor=2.0, bias_update_rate=0.01))
    cfg.data.seq_len = 64
    cfg.validate()
    assert export_family(cfg.model) == ("deepseek_v3" if attention == "mla" else "glm4_moe")
    model = Transformer(cfg.model)
    model.init_weights(seed=3)
    with torch.no_grad():  # non-zero biases, so their mapping and RoPE permutation are exercised
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(name)))
    train_steps(model)
    out = save_hf(model, cfg, tmp_path / "export")
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    x = tokens(seed=4)
    with torch.no_grad():
        assert hf_tiny.relative_error(model(x), loaded(x).logits) < TOL


def edit_config(directory, tmp_path, **changes):
    copy = tmp_path / "edited"
    shutil.copytree(directory, copy)
    data = json.loads((copy / "config.json").read_text())
    data.update(changes)
    (copy / "config.json").write_text(json.dumps(data))
    return copy


@pytest.mark.parametrize("variant, changes, expected", [
    ("deepseek_v3", {"num_key_value_heads": 2}, "num_key_value_heads = 2 is not supported"),
    ("deepseek_v3", {"attention_bias": True}, "attention_bias = True is not supported"),
    ("deepseek_v3", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
     "rope_type = 'dynamic' is not supported"),
    ("deepseek_v3", {"rope_parameters": {**YARN, "attention_factor": 1.2}}, "rope_parameters.attention_factor"),
    ("deepseek_v3", {"n_shared_experts": 0}, "n_shared_experts = 0 is not supported"),
    ("deepseek_v3", {"topk_method": "greedy"}, "topk_method = 'greedy' is not supported"),
    ("deepseek_v3", {"q_lora_rank": 10}, "has shape [12, 32], config.json implies [10, 32]"),
    ("glm4_moe", {"hidden_act": "gelu"}, "hidden_act = 'gelu' is not supported"),
    ("glm4_moe", {"n_group": 3}, "model.moe.n_group = 3 is invalid"),
])
def test_unsupported_or_inconsistent_directories_fail_in_one_line(hf_dirs, tmp_path, variant, changes, expected):
    _, directory = hf_dirs[variant]
    with pytest.raises(ConfigError) as err:
        load_hf_model(edit_config(directory, tmp_path, **changes))
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_multi_token_prediction_layers_are_dropped_with_one_warning(hf_dirs, tmp_path, caplog):
    hf_model, directory = hf_dirs["deepseek_v3"]
    copy = edit_config(directory, tmp_path, num_nextn_predict_layers=1)
    state = load_file(str(copy / "model.safetensors"))
    # DeepSeek-V3's files keep the MTP block as one layer past num_hidden_layers.
    state["model.layers.3.eh_proj.weight"] = torch.zeros(32, 64)
    state["model.layers.3.self_attn.kv_b_proj.weight"] = torch.zeros(40, 16)
    save_file(state, str(copy / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="moetrain"):
        model, _ = load_hf_model(copy)
    warnings = [r.getMessage() for r in caplog.records if "num_nextn_predict_layers" in r.getMessage()]
    assert len(warnings) == 1 and "num_nextn_predict_layers = 1 dropped" in warnings[0]
    x = tokens()
    with torch.no_grad():
        assert hf_tiny.relative_error(model(x), hf_model(x).logits) < TOL


def test_models_no_family_fits_are_refused_for_export():
    mla = ModelConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    with pytest.raises(ConfigError, match="model.moe.score_func = 'softmax' cannot be exported.*sigmoid"):
        export_family(mla)
    sigmoid_no_shared = ModelConfig(moe=MoEConfig(score_func="sigmoid"))
    with pytest.raises(ConfigError, match="model.moe.n_shared_experts = 0 cannot be exported.*always has shared"):
        export_family(sigmoid_no_shared)
    rounding = ModelConfig(moe=MoEConfig(score_func="sigmoid", n_shared_experts=1, token_rounding_tile=4))
    with pytest.raises(ConfigError, match="model.moe.token_rounding_tile = 4 cannot be exported"):
        export_family(rounding)


def test_bfloat16_export_keeps_router_and_correction_bias_in_float32(hf_dirs, tmp_path):
    # transformers keeps both in float32 (_keep_in_fp32_modules_strict); a bf16 bias would move expert choices.
    from transformers import AutoModelForCausalLM

    _, directory = hf_dirs["deepseek_v3"]
    model, cfg = load_hf_model(directory)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init_from=None))
    out = save_hf(model, cfg, tmp_path / "bf16", dtype=torch.bfloat16)
    stored = load_file(str(next(out.glob("*.safetensors"))))
    assert stored["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert torch.equal(stored["model.layers.1.mlp.gate.e_score_correction_bias"], model.layers[1].moe.expert_bias)
    assert stored["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert stored["model.layers.1.mlp.shared_experts.gate_proj.weight"].dtype == torch.bfloat16
    assert stored["model.layers.1.self_attn.kv_b_proj.weight"].dtype == torch.bfloat16
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())


@pytest.mark.parametrize("fields, message", [
    ({"partial_rotary_factor": 0.5}, "partial rotary is computed in the 'half' RoPE layout only"),
    ({"partial_rotary_factor": 0.0}, "model.partial_rotary_factor = 0.0 is invalid"),
    ({"partial_rotary_factor": 0.3, "rope_layout": "half"}, "must rotate an even number of channels"),
    ({"rope_scaling": "yarn", "rope_yarn_factor": 0.5}, "model.rope_yarn_factor = 0.5 is invalid"),
    ({"kv_lora_rank": 16, "qk_rope_head_dim": 3}, "model.qk_rope_head_dim = 3 is invalid"),
    ({"kv_lora_rank": 16, "q_lora_rank": 0}, "model.q_lora_rank = 0 is invalid"),
    ({"kv_lora_rank": 16, "attention_bias": "qkv"}, "MLA (model.kv_lora_rank set) has no projection biases"),
])
def test_attention_variant_settings_are_refused_in_one_line(fields, message):
    cfg = JobConfig()
    cfg.model = dataclasses.replace(cfg.model, **fields)
    with pytest.raises(ConfigError) as err:
        cfg.validate()
    assert message in str(err.value) and "\n" not in str(err.value)


def test_mla_model_needs_no_grouped_query_head_width():
    # dim / n_heads = 36 / 8 is not an integer: irrelevant to MLA, whose widths are its own fields.
    cfg = JobConfig()
    cfg.model = dataclasses.replace(cfg.model, dim=36, n_heads=8, kv_lora_rank=16, qk_nope_head_dim=8,
                                    qk_rope_head_dim=4, v_head_dim=8)
    cfg.validate()
    model = Transformer(cfg.model)
    model.init_weights()
    assert model(tokens(shape=(1, 8))).shape == (1, 8, cfg.model.vocab_size)


def test_importing_without_aux_free_balancing_is_refused(hf_dirs):
    # The files' correction bias chooses experts only under aux-free balancing: without it the model differs.
    _, directory = hf_dirs["deepseek_v3"]
    cfg = hf_job_config(directory).model
    model = Transformer(dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, load_balance="aux_loss")))
    with pytest.raises(ConfigError) as err:
        load_hf_weights(model, directory)
    assert "model.moe.load_balance = 'aux_loss' is invalid" in str(err.value) and "\n" not in str(err.value)
