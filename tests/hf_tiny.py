"""Tiny random Qwen3-MoE, OLMoE, Mixtral, Qwen2-MoE, GPT-OSS, DeepSeek-V3 and GLM-4.5 models from
transformers' own config classes (nothing downloaded), and the one table of them the family tests run on.

`VARIANTS` names every tiny model the family tests use (`build_variant(name)`); `build(family,
**overrides)` makes a float32 model in eval mode whose weights are all random (norm weights, biases,
sinks and persistent buffers too, so a wrong QK-norm, RoPE permutation, bias or correction bias shows
in the logits); `save(model, dir)` writes it with `save_pretrained` plus a byte-level tokenizer.json;
`edit_config` copies a saved directory with config.json changed; `architecture_args` gives the
command-line overrides a job needs to agree with a directory. Shared by the unit, distributed and
end-to-end tests (tests/ is on sys.path through tests/conftest.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from moetrain.data.tokenizer import write_byte_level_tokenizer
from moetrain.interop import architecture, hf_job_config

VOCAB = 272  # the byte tokenizer's 259 ids fit; the rest are rows no token uses
SPECIAL_IDS = {"bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258}
FAMILIES = ("qwen3_moe", "olmoe", "mixtral", "qwen2_moe", "gpt_oss", "deepseek_v3", "glm4_moe")
_FULL_ROTARY = {"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 1.0}
_DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 1000.0, "factor": 4.0, "original_max_position_embeddings": 32,
                  "mscale": 0.9, "mscale_all_dim": 1.0, "beta_fast": 16.0, "beta_slow": 2.0}
# variant -> (seed, config overrides): every tiny model a family test builds. The family is the name before
# the first "-"; the rest says what the variant changes from the family's tiny default.
VARIANTS: dict[str, tuple[int, dict]] = {
    "qwen3_moe": (0, {}),
    "qwen3_moe-dense0-tied-nonorm": (1, {"mlp_only_layers": [0], "tie_word_embeddings": True,
                                         "norm_topk_prob": False}),
    "olmoe": (2, {}),
    "olmoe-clip-norm": (3, {"clip_qkv": 0.3, "norm_topk_prob": True}),
    "mixtral": (10, {}),
    "mixtral-window-tied": (11, {"sliding_window": 6, "tie_word_embeddings": True}),
    "qwen2_moe": (12, {}),
    "qwen2_moe-dense0-norm": (13, {"mlp_only_layers": [0], "norm_topk_prob": True}),
    "gpt_oss": (14, {}),
    "gpt_oss-nobias-alltypes": (15, {"attention_bias": False, "num_hidden_layers": 4,
                                     "layer_types": ["full_attention", "sliding_attention", "sliding_attention",
                                                     "full_attention"]}),
    # YaRN as the released gpt-oss models ship it (scaled down: original context 16, factor 8, no truncation)
    "gpt_oss-yarn": (16, {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.5e5, "factor": 8.0,
                                              "beta_fast": 32.0, "beta_slow": 1.0,
                                              "original_max_position_embeddings": 16, "truncate": False}}),
    "deepseek_v3": (10, {}),
    "deepseek_v3-fullq-half": (11, {"q_lora_rank": None, "rope_interleave": False}),
    "deepseek_v3-yarn-nonorm": (12, {"rope_parameters": _DEEPSEEK_YARN, "norm_topk_prob": False}),
    "deepseek_v3-widev-ungrouped": (13, {"v_head_dim": 16, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0,
                                         "tie_word_embeddings": True, "n_shared_experts": 2}),
    "glm4_moe": (14, {}),
    "glm4_moe-fullrotary-nobias": (15, {"rope_parameters": _FULL_ROTARY, "attention_bias": False,
                                        "use_qk_norm": False}),
    "glm4_moe-fullrotary-bias": (16, {"rope_parameters": _FULL_ROTARY}),
}


def family_of(variant: str) -> str:
    return variant.split("-")[0]


def build_variant(variant: str):
    """The transformers model of a `VARIANTS` entry."""
    seed, overrides = VARIANTS[variant]
    return build(family_of(variant), seed=seed, **overrides)


def config(family: str, **overrides):
    from transformers import (
        DeepseekV3Config,
        Glm4MoeConfig,
        GptOssConfig,
        MixtralConfig,
        OlmoeConfig,
        Qwen2MoeConfig,
        Qwen3MoeConfig,
    )

    rope = {"rope_type": "default", "rope_theta": 1000.0}
    if family == "mixtral":
        fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=8, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=2,
                      max_position_embeddings=128, rope_parameters=rope, **SPECIAL_IDS)
        fields.update(overrides)
        return MixtralConfig(**fields)
    if family == "qwen2_moe":
        fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=8,
                      shared_expert_intermediate_size=20, num_experts=6, num_experts_per_tok=2,
                      max_position_embeddings=128, rope_parameters=rope, **SPECIAL_IDS)
        fields.update(overrides)
        return Qwen2MoeConfig(**fields)
    if family == "gpt_oss":
        # A window of 5 tokens (sequences are longer) and a clamp limit the pre-activations cross.
        fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=8, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_local_experts=6,
                      num_experts_per_tok=2, sliding_window=5, swiglu_limit=0.3, max_position_embeddings=128,
                      rope_parameters=rope, **SPECIAL_IDS)
        fields.update(overrides)
        return GptOssConfig(**fields)

    # DeepSeek-V3 and GLM-4.5: no multi-token-prediction layer (transformers would declare one and save none of
    # its tensors); tests/unit/test_mtp_interop.py builds directories that hold them.
    if family == "deepseek_v3":
        # Group-limited routing (4 groups of 2, 2 chosen), routed_scaling_factor != 1, a shared expert, a dense
        # first layer, the low-rank query path and a value width unlike the query width.
        fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, moe_intermediate_size=8,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                      n_routed_experts=8, kv_lora_rank=16, q_lora_rank=12, qk_rope_head_dim=4, v_head_dim=6,
                      qk_nope_head_dim=8, n_group=4, topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1,
                      routed_scaling_factor=2.5, max_position_embeddings=128, num_nextn_predict_layers=0,
                      rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, **SPECIAL_IDS)
        fields.update(overrides)
        return DeepseekV3Config(**fields)
    if family == "glm4_moe":
        fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, moe_intermediate_size=8,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                      n_shared_experts=1, n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2,
                      first_k_dense_replace=1, routed_scaling_factor=1.5, attention_bias=True, use_qk_norm=True,
                      max_position_embeddings=128, num_nextn_predict_layers=0,
                      rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5},
                      **SPECIAL_IDS)
        fields.update(overrides)
        return Glm4MoeConfig(**fields)
    if family == "qwen3_moe":
        fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=12, moe_intermediate_size=8,
                      num_experts=6, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=128,
                      rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, **SPECIAL_IDS)
        fields.update(overrides)
        return Qwen3MoeConfig(**fields)
    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=8, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts=6, num_experts_per_tok=2, max_position_embeddings=128,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, **SPECIAL_IDS)
    fields.update(overrides)
    return OlmoeConfig(**fields)


def build(family: str, seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config(family, **overrides)).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.3 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
        # Persistent buffers too (DeepSeek-V3's e_score_correction_bias), or a mis-mapped one stays hidden.
        persistent = set(model.state_dict())
        for name, buffer in model.named_buffers():
            if name in persistent and buffer.is_floating_point():
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=gen))
    return model


def save(model, directory: str | Path) -> Path:
    directory = Path(directory)
    model.save_pretrained(directory)
    write_byte_level_tokenizer(directory / "tokenizer.json")
    return directory


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|."""
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


def edit_config(directory: str | Path, tmp_path: Path, **changes) -> Path:
    """A copy of a saved directory (tmp_path/edited) whose config.json has `changes` applied."""
    copy = tmp_path / "edited"
    shutil.copytree(directory, copy)
    data = json.loads((copy / "config.json").read_text())
    data.update(changes)
    (copy / "config.json").write_text(json.dumps(data))
    return copy


def tokens(seed: int = 0, shape=(2, 24)) -> torch.Tensor:
    """Random byte-tokenizer ids."""
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed))


def architecture_args(directory) -> list[str]:
    """--model.* overrides describing the directory's architecture (the TOML must agree with config.json)."""
    cfg = hf_job_config(directory)
    args = []
    for name, value in architecture(cfg.model).items():
        if value is not None:
            args += [f"--model.{name}", str(value)]
    return args


def train_steps(model, steps: int = 3, lr: float = 1e-2, update_expert_bias: bool = True) -> None:
    """A few AdamW steps on the LM and balance losses (with the aux-free bias update after each, as the
    trainer), on fixed token batches; leaves the model in eval mode."""
    from moetrain.config.train import TrainConfig
    from moetrain.train.loss import microbatch_loss, token_loss_sum
    from moetrain.train.optim import build_optimizer

    optimizer = build_optimizer(model, TrainConfig(lr=lr, weight_decay=0.0))
    model.train()
    for step in range(steps):
        x = tokens(seed=20 + step, shape=(2, 17))
        loss_sum, n_valid = token_loss_sum(model(x[:, :-1]), x[:, 1:])
        microbatch_loss(loss_sum, n_valid, n_valid, model.aux_loss()).backward()
        optimizer.step()
        optimizer.zero_grad()
        if update_expert_bias:
            model.update_expert_bias()
    model.eval()
