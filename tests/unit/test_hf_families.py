"""The Hugging Face family registry: an unknown model_type is refused in one line, and every registered
family maps a hand-written config.json to the hand-written ModelConfig it means and back."""

from __future__ import annotations

import pytest
import torch

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.data.tokenizer import build_tokenizer
from moetrain.errors import ConfigError
from moetrain.interop import ARCH_FIELDS, FAMILIES, hf_config, model_config_from_hf
from moetrain.interop.families import family

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
                    rope_yarn_original_max_seq_len=32, rope_yarn_mscale=1.0, rope_yarn_mscale_all_dim=1.0,
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
