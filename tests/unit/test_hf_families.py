"""Every Hugging Face family in and out of moetrain, against transformers' own models (tiny, random, float32).

One parametrized module over `hf_tiny.VARIANTS`: Qwen3-MoE, OLMoE, Mixtral, Qwen2-MoE, GPT-OSS,
DeepSeek-V3 and GLM-4.5, each with variants that switch on what the family can say (dense first
layers, tied heads, clip_qkv, sliding windows, biases, sinks, YaRN, MLA with and without the low-rank
query, group-limited routing, partial rotary). Every parameter and persistent buffer of the
transformers model is redrawn, so a mis-mapped tensor shows in the logits.

- Import: logits equal transformers' on the same tokens to 1e-5 relative (max |diff| / max |logit|), in
  every RoPE layout moetrain can keep; packed documents equal transformers run on each document alone.
- Export after three optimizer steps (every tensor moved, the aux-free correction bias too):
  `from_pretrained` loads it with no missing, unexpected or mismatched keys and computes moetrain's
  logits, and moetrain reads its own export back bit for bit.
- Every bad directory, and every model a family cannot hold, fails in one ConfigError line; so does an
  unknown model_type. Every registered family maps a hand-written config.json to the ModelConfig it
  means and back, and names what fixes every architecture field.
Family-specific checks follow the shared ones, under the family they concern.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import hf_tiny
from hf_tiny import VARIANTS, build_variant, edit_config, family_of, relative_error, tokens, train_steps
from moetrain.config.job import JobConfig
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.data.tokenizer import build_tokenizer
from moetrain.errors import ConfigError
from moetrain.interop import (
    ARCH_FIELDS,
    FAMILIES,
    check_architecture,
    export_family,
    hf_config,
    hf_job_config,
    load_hf_weights,
    model_config_from_hf,
    save_hf,
)
from moetrain.interop.families import family
from moetrain.model.transformer import Transformer
from moetrain.train.build import load_hf_model

TOL = 1e-5


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """variant -> (transformers model, saved directory)."""
    out = {}
    for variant in VARIANTS:
        model = build_variant(variant)
        out[variant] = (model, hf_tiny.save(model, tmp_path_factory.mktemp(variant)))
    return out


def interleavable(cfg: ModelConfig) -> bool:
    """Whether moetrain can also keep the files in its interleaved RoPE layout (q/k rows permuted): grouped-query
    attention rotating every channel. MLA keeps the files' own order; partial rotary needs the half layout."""
    return cfg.kv_lora_rank is None and cfg.partial_rotary_factor == 1


def with_layout(cfg: JobConfig, directory, layout: str) -> Transformer:
    model = Transformer(dataclasses.replace(cfg.model, rope_layout=layout))
    load_hf_weights(model, directory)
    return model


def stored_names(directory) -> set[str]:
    names = set()
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as handle:
            names.update(handle.keys())
    return names


# --- the registry: every family's config.json <-> ModelConfig mapping, by hand ------------------------------------


# model_type -> (a config.json as the family's own tooling writes it, the ModelConfig it means).
EXPECTED = {
    "qwen3_moe": (
        {"model_type": "qwen3_moe", "vocab_size": 300, "hidden_size": 32, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 48,
         "mlp_only_layers": [0], "decoder_sparse_step": 1, "max_position_embeddings": 128,
         "rope_theta": 1e6, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "num_experts": 8,
         "num_experts_per_tok": 2, "moe_intermediate_size": 12, "norm_topk_prob": True,
         "router_aux_loss_coef": 0.001, "hidden_act": "silu"},
        ModelConfig(vocab_size=300, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, ffn_hidden=48,
                    n_dense_layers=1, qk_norm="per_head", max_seq_len=128, rope_theta=1e6, rope_layout="half",
                    norm_eps=1e-5, tie_embeddings=False,
                    moe=MoEConfig(n_experts=8, top_k=2, expert_hidden=12, n_shared_experts=0, score_func="softmax",
                                  renormalize=True, activation="swiglu", aux_loss_coef=0.001)),
    ),
    "olmoe": (
        {"model_type": "olmoe", "vocab_size": 300, "hidden_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 12, "clip_qkv": 0.5,
         "max_position_embeddings": 64, "rope_theta": 1e4, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
         "num_experts": 6, "num_experts_per_tok": 3, "norm_topk_prob": False, "router_aux_loss_coef": 0.01},
        ModelConfig(vocab_size=300, dim=32, n_layers=2, n_heads=4, n_kv_heads=4, head_dim=8, ffn_hidden=12,
                    n_dense_layers=0, qk_norm="full", clip_qkv=0.5, max_seq_len=64, rope_theta=1e4,
                    rope_layout="half", norm_eps=1e-5, tie_embeddings=True,
                    moe=MoEConfig(n_experts=6, top_k=3, expert_hidden=12, n_shared_experts=0, score_func="softmax",
                                  renormalize=False, activation="swiglu", aux_loss_coef=0.01)),
    ),
    "mixtral": (
        {"model_type": "mixtral", "vocab_size": 300, "hidden_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": None, "intermediate_size": 14,
         "max_position_embeddings": 256, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
         "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "num_local_experts": 8, "num_experts_per_tok": 2,
         "sliding_window": 64, "router_jitter_noise": 0.0, "router_aux_loss_coef": 0.02, "hidden_act": "silu"},
        ModelConfig(vocab_size=300, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_hidden=14,
                    n_dense_layers=0, max_seq_len=256, rope_theta=1e6, rope_layout="half", norm_eps=1e-5,
                    sliding_window=64,
                    moe=MoEConfig(n_experts=8, top_k=2, expert_hidden=14, n_shared_experts=0, score_func="softmax",
                                  renormalize=True, activation="swiglu", aux_loss_coef=0.02)),
    ),
    "qwen2_moe": (
        {"model_type": "qwen2_moe", "vocab_size": 300, "hidden_size": 32, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 40, "mlp_only_layers": [],
         "decoder_sparse_step": 1, "moe_intermediate_size": 10, "shared_expert_intermediate_size": 24,
         "num_experts": 6, "num_experts_per_tok": 4, "norm_topk_prob": False, "qkv_bias": True,
         "use_sliding_window": False, "sliding_window": 0, "max_position_embeddings": 128, "rope_theta": 1e6,
         "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "router_aux_loss_coef": 0.001},
        ModelConfig(vocab_size=300, dim=32, n_layers=3, n_heads=4, n_kv_heads=4, head_dim=8, ffn_hidden=40,
                    n_dense_layers=0, max_seq_len=128, rope_theta=1e6, rope_layout="half", norm_eps=1e-6,
                    attention_bias="qkv",
                    moe=MoEConfig(n_experts=6, top_k=4, expert_hidden=10, n_shared_experts=1, shared_expert_hidden=24,
                                  shared_expert_gate=True, score_func="softmax", renormalize=False,
                                  activation="swiglu", aux_loss_coef=0.001)),
    ),
    "gpt_oss": (
        {"model_type": "gpt_oss", "vocab_size": 300, "hidden_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 24,
         "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16, "attention_bias": True,
         "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "max_position_embeddings": 512,
         "rope_parameters": {"rope_type": "default", "rope_theta": 1.5e5}, "rms_norm_eps": 1e-5,
         "tie_word_embeddings": False, "num_local_experts": 8, "num_experts_per_tok": 4,
         "router_aux_loss_coef": 0.001},
        ModelConfig(vocab_size=300, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_hidden=24,
                    n_dense_layers=0, max_seq_len=512, rope_theta=1.5e5, rope_layout="half", norm_eps=1e-5,
                    attention_bias="all", attention_sinks=True, sliding_window=16,
                    layer_types=["sliding_attention", "full_attention"],
                    moe=MoEConfig(n_experts=8, top_k=4, expert_hidden=24, n_shared_experts=0, score_func="softmax",
                                  renormalize=True, activation="clamped_swiglu", router_bias=True,
                                  expert_proj_bias=True, aux_loss_coef=0.001)),
    ),
    # As DeepSeek's own config.json writes it: the older top-level rope_theta + rope_scaling, the MTP layer count.
    "deepseek_v3": (
        {"model_type": "deepseek_v3", "vocab_size": 300, "hidden_size": 32, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 48, "moe_intermediate_size": 12,
         "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
         "routed_scaling_factor": 2.5, "first_k_dense_replace": 1, "norm_topk_prob": True, "kv_lora_rank": 16,
         "q_lora_rank": 24, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "topk_method": "noaux_tc",
         "scoring_func": "sigmoid", "num_nextn_predict_layers": 1, "max_position_embeddings": 256,
         "rms_norm_eps": 1e-6, "rope_theta": 1e4, "hidden_act": "silu", "tie_word_embeddings": False,
         "rope_scaling": {"type": "yarn", "factor": 8, "original_max_position_embeddings": 32, "beta_fast": 32,
                          "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}},
        ModelConfig(vocab_size=300, dim=32, n_layers=3, n_heads=4, ffn_hidden=48, n_dense_layers=1, max_seq_len=256,
                    rope_theta=1e4, rope_layout="interleaved", norm_eps=1e-6, kv_lora_rank=16, q_lora_rank=24,
                    qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, rope_scaling="yarn", rope_yarn_factor=8.0,
                    rope_yarn_original_max_seq_len=32, rope_yarn_mscale=1.0, rope_yarn_mscale_all_dim=1.0, mtp_depth=1,
                    moe=MoEConfig(n_experts=8, top_k=2, expert_hidden=12, n_shared_experts=1, score_func="sigmoid",
                                  renormalize=True, load_balance="aux_free", n_group=4, topk_group=2,
                                  routed_scaling_factor=2.5)),
    ),
    # As GLM-4.5-Air's config.json writes it: partial_rotary_factor at the top level.
    "glm4_moe": (
        {"model_type": "glm4_moe", "vocab_size": 300, "hidden_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 48,
         "moe_intermediate_size": 12, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
         "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "first_k_dense_replace": 1,
         "norm_topk_prob": True, "attention_bias": True, "use_qk_norm": False, "partial_rotary_factor": 0.5,
         "rope_theta": 1e6, "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "num_nextn_predict_layers": 0,
         "hidden_act": "silu", "tie_word_embeddings": False},
        ModelConfig(vocab_size=300, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_hidden=48,
                    n_dense_layers=1, max_seq_len=128, rope_theta=1e6, rope_layout="half", norm_eps=1e-5,
                    attention_bias="qkv", partial_rotary_factor=0.5,
                    moe=MoEConfig(n_experts=8, top_k=2, expert_hidden=12, n_shared_experts=1, score_func="sigmoid",
                                  renormalize=True, load_balance="aux_free")),
    ),
}


def test_unknown_model_type_is_refused_in_one_line():
    with pytest.raises(ConfigError) as err:
        family("llama", "some/config.json")
    assert str(err.value) == ("some/config.json: model_type = 'llama' is not a supported family; supported: "
                              "qwen3_moe (Qwen3MoeForCausalLM), olmoe (OlmoeForCausalLM), "
                              "mixtral (MixtralForCausalLM), qwen2_moe (Qwen2MoeForCausalLM), "
                              "gpt_oss (GptOssForCausalLM), deepseek_v3 (DeepseekV3ForCausalLM), "
                              "glm4_moe (Glm4MoeForCausalLM)")
    with pytest.raises(ConfigError, match="model_type = None is not a supported family"):
        family(None)


def test_every_registered_family_has_an_expectation_here():
    assert set(EXPECTED) == set(FAMILIES)


@pytest.mark.parametrize("model_type", EXPECTED)
def test_family_maps_its_config_json_to_the_expected_model_config_and_back(model_type):
    config_json, expected = EXPECTED[model_type]
    assert model_config_from_hf(config_json, model_type) == expected
    written = hf_config(expected, model_type, build_tokenizer("byte"), torch.bfloat16)
    assert written["model_type"] == model_type and written["architectures"] == [FAMILIES[model_type].architecture]
    assert written["dtype"] == "bfloat16"
    assert model_config_from_hf(written, model_type) == expected


@pytest.mark.parametrize("model_type", EXPECTED)
def test_family_names_what_fixes_every_architecture_field(model_type):
    assert set(FAMILIES[model_type].field_names) == set(ARCH_FIELDS)


def test_no_two_families_share_an_export_key():
    keys = [tuple(sorted(f.export_key.items())) for f in FAMILIES.values()]
    assert len(set(keys)) == len(keys)


# --- every family ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_imported_logits_equal_transformers_in_every_rope_layout_moetrain_keeps(hf_dirs, variant):
    hf_model, directory = hf_dirs[variant]
    model, cfg = load_hf_model(directory)
    assert export_family(cfg.model) == family_of(variant)
    assert cfg.data.tokenizer == str(directory)
    # DeepSeek-V3's MLA keeps the files' layout (rope_interleave); every grouped-query family's files are "half".
    interleaved_files = family_of(variant) == "deepseek_v3" and variant != "deepseek_v3-fullq-half"
    assert cfg.model.rope_layout == ("interleaved" if interleaved_files else "half")
    x = tokens()
    with torch.no_grad():
        want = hf_model(x).logits
        assert relative_error(model(x), want) < TOL
        if interleavable(cfg.model):  # q/k rows and their biases permuted
            assert relative_error(with_layout(cfg, directory, "interleaved")(x), want) < TOL


PACKED = [
    *((variant, None) for variant in ("qwen3_moe", "olmoe")),
    *((variant, attention) for variant in ("mixtral-window-tied", "qwen2_moe", "gpt_oss", "gpt_oss-nobias-alltypes")
      for attention in ("dense", "segments", "blocks", "auto")),
    *((variant, attention) for variant in ("deepseek_v3", "deepseek_v3-widev-ungrouped", "glm4_moe")
      for attention in ("dense", "segments", "blocks", "flex")),
]


@pytest.mark.parametrize("variant, attention", PACKED)
def test_packed_documents_equal_transformers_run_per_document(hf_dirs, variant, attention):
    hf_model, directory = hf_dirs[variant]
    cfg = hf_job_config(directory)
    model = Transformer(dataclasses.replace(cfg.model, attention=attention or cfg.model.attention))
    load_hf_weights(model, directory)
    lengths = [7, 1, 11, 5, 16]  # documents shorter and longer than the windows (5 and 6)
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).unsqueeze(0)
    x = tokens(seed=3, shape=(1, sum(lengths)))
    with torch.no_grad():
        packed = model(x, document_ids=document_ids)[0]
        start = 0
        for n in lengths:
            alone = hf_model(x[:, start:start + n]).logits[0]
            assert relative_error(packed[start:start + n], alone) < TOL, (start, n)
            start += n


@pytest.mark.parametrize("variant, first_moe_layer", [("qwen3_moe", 0), ("deepseek_v3", 1)])
def test_fused_expert_layout_loads_like_the_per_expert_layout(hf_dirs, tmp_path, variant, first_moe_layer):
    # transformers 5 holds experts fused in memory (gate_up_proj [E, 2n, d]) and from_pretrained
    # accepts that layout on disk too, so moetrain reads it as well.
    hf_model, directory = hf_dirs[variant]
    fused = tmp_path / "fused"
    fused.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copyfile(directory / name, fused / name)
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    assert f"model.layers.{first_moe_layer}.mlp.experts.gate_up_proj" in state
    save_file(state, str(fused / "model.safetensors"), metadata={"format": "pt"})
    model, _ = load_hf_model(fused)
    reference, _ = load_hf_model(directory)
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("variant", VARIANTS)
def test_export_after_training_loads_in_transformers_with_equal_logits(hf_dirs, variant, tmp_path):
    from transformers import AutoModelForCausalLM

    hf_model, directory = hf_dirs[variant]
    cfg = hf_job_config(directory)
    layout = "interleaved" if interleavable(cfg.model) else cfg.model.rope_layout
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, rope_layout=layout, init_from=None))
    model = with_layout(cfg, directory, layout)
    aux_free = cfg.model.moe.load_balance == "aux_free"
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    bias_before = model.moe_layers()[0].expert_bias.clone()
    train_steps(model)
    assert [k for k, v in model.named_parameters() if torch.equal(v, before[k])] == []
    if aux_free:  # the aux-free update moved the correction bias
        assert not torch.equal(model.moe_layers()[0].expert_bias, bias_before)
    out = save_hf(model, cfg, tmp_path / "export")
    stored = load_file(str(next(out.glob("*.safetensors"))))
    last, last_expert = cfg.model.n_layers - 1, cfg.model.moe.n_experts - 1
    if family_of(variant) not in ("mixtral", "gpt_oss"):  # per expert, as save_pretrained writes
        assert f"model.layers.{last}.mlp.experts.{last_expert}.gate_proj.weight" in stored
    if aux_free:
        assert torch.equal(stored[f"model.layers.{last}.mlp.gate.e_score_correction_bias"],
                           model.layers[last].moe.expert_bias)
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set())
    assert type(loaded).__name__ == type(hf_model).__name__
    x = tokens(seed=1)
    with torch.no_grad():
        ours = model(x)
        assert relative_error(ours, loaded.float().eval()(x).logits) < TOL
        assert relative_error(ours, hf_model(x).logits) > 1e-4  # training changed the model
    assert (out / "tokenizer.json").read_bytes() == (directory / "tokenizer.json").read_bytes()
    # and moetrain reads its own export back bit for bit
    again = with_layout(cfg, out, layout)
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values(), strict=True):
        if "expert_bias" not in name or aux_free:
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


YARN = hf_tiny.VARIANTS["deepseek_v3-yarn-nonorm"][1]["rope_parameters"]


@pytest.mark.parametrize("variant, changes, expected", [
    ("qwen3_moe", {"model_type": "llama"}, "model_type = 'llama' is not a supported family"),
    ("qwen3_moe", {"use_sliding_window": True}, "use_sliding_window = True is not supported"),
    ("qwen3_moe", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_type = 'yarn'"),
    ("qwen3_moe", {"attention_bias": True}, "attention_bias = True is not supported"),
    ("qwen3_moe", {"hidden_act": "gelu"}, "hidden_act = 'gelu' is not supported"),
    ("qwen3_moe", {"mlp_only_layers": [1]}, "dense layers must be the first ones"),
    ("qwen3_moe", {"num_experts": 8}, "tensor model.layers.0.mlp.experts.6.gate_proj.weight is missing"),
    ("qwen3_moe", {"moe_intermediate_size": 9}, "has shape [8, 32], config.json implies [9, 32]"),
    ("gpt_oss", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1.5e5}},
     "rope_type = 'dynamic'"),
    ("gpt_oss", {"layer_types": ["sliding_attention"]}, "layer_types = ['sliding_attention'] is not supported"),
    ("gpt_oss", {"sliding_window": None}, "sliding_window = None is not supported"),
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise = 0.1 is not supported"),
    ("qwen2_moe", {"use_sliding_window": True}, "use_sliding_window = True is not supported"),
    ("qwen2_moe", {"qkv_bias": False}, "qkv_bias = False is not supported"),
    ("qwen2_moe", {"shared_expert_intermediate_size": 21}, "config.json implies [21, 32]"),
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


# --- what no family, or not this family, can hold ---------------------------------------------------------------


def test_softmax_models_outside_the_families_are_refused_for_export():
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


def test_sigmoid_models_no_family_fits_are_refused_for_export():
    mla = ModelConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    with pytest.raises(ConfigError, match="model.moe.score_func = 'softmax' cannot be exported.*sigmoid"):
        export_family(mla)
    sigmoid_no_shared = ModelConfig(moe=MoEConfig(score_func="sigmoid"))
    with pytest.raises(ConfigError, match="model.moe.n_shared_experts = 0 cannot be exported.*always has shared"):
        export_family(sigmoid_no_shared)
    rounding = ModelConfig(moe=MoEConfig(score_func="sigmoid", n_shared_experts=1, token_rounding_tile=4))
    with pytest.raises(ConfigError, match="model.moe.token_rounding_tile = 4 cannot be exported"):
        export_family(rounding)


# --- GPT-OSS --------------------------------------------------------------------------------------------------


def test_the_tiny_gpt_oss_exercises_its_window_sinks_and_clamp():
    gpt = hf_tiny.config("gpt_oss")
    assert gpt.sliding_window < 24 and "sliding_attention" in gpt.layer_types and "full_attention" in gpt.layer_types
    model = hf_tiny.build("gpt_oss")
    assert model.config._attn_implementation == "eager"  # the one with sinks
    h = model.model.layers[0].mlp.experts
    assert h.limit == 0.3
    x = torch.randn(64, 32)
    gate_up = x @ h.gate_up_proj[0] + h.gate_up_proj_bias[0]
    assert (gate_up[..., 0::2] > h.limit).any() and (gate_up[..., 1::2].abs() > h.limit).any()


# --- DeepSeek-V3 and GLM-4.5 ----------------------------------------------------------------------------------


def test_imported_deepseek_has_the_shapes_of_the_variant(hf_dirs):
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
        assert relative_error(model(x), before) > 1e-3


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
        assert relative_error(model(x), loaded(x).logits) < TOL


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
