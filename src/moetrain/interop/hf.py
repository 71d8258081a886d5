"""Hugging Face interop for two MoE families: Qwen3-MoE (`Qwen3MoeForCausalLM`) and OLMoE (`OlmoeForCausalLM`).

What a model directory holds and how moetrain reads and writes it:
- config.json: `model_config_from_hf` maps it to a `ModelConfig` (refusing, in one line, every
  option moetrain does not compute the same way), `hf_config` maps back. Qwen3-MoE is QK-norm per
  head, free head_dim, optional dense first layers (`mlp_only_layers`); OLMoE is QK-norm over the
  full projected width, optional `clip_qkv`, every layer MoE. Both: softmax top-k router with or
  without renormalised gates, SwiGLU experts, RMSNorm, RoPE in the "rotate half" layout.
- safetensors files (one or several, with model.safetensors.index.json): the names below. Experts
  are stored one tensor per expert (`mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`), which is
  what `save_pretrained` writes; the fused in-memory layout of transformers 5
  (`mlp.experts.gate_up_proj` [E, 2n, d], `mlp.experts.down_proj` [E, d, n]) is read too. moetrain's
  stacked `experts.w1` [E, d, 2n] (gate | up) is gate_up_proj transposed per expert.
- tokenizer.json (+ tokenizer_config.json): travels with the model (`moetrain.data.tokenizer`).

RoPE: a model kept in moetrain's interleaved layout has the rows of each q/k head (and the QK-norm
weights) permuted at conversion (`moetrain.model.layers.rope_permutation`), so it computes the same
function; a model kept in the "half" layout converts without any change.

Reading and writing go through torch.distributed.checkpoint's Hugging Face storage reader and
writer, so a model sharded with FSDP/HSDP is imported and exported shard by shard: each rank reads
or writes only the slices (and the experts) it holds, and the sharded export is consolidated into
whole-tensor files one tensor at a time; no rank ever holds the whole model. Only q/k weights of an
interleaved-layout model are gathered whole (one matrix at a time) for the permutation, and expert
blocks that expert parallelism had FSDP shard on dim 1 are gathered to whole experts of their rank.
This module converts formats; it builds no process group and parses no command line.
"""

from __future__ import annotations

import json
import math
import shutil
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from moetrain.config import JobConfig, ModelConfig, MoEConfig
from moetrain.data.tokenizer import (
    BYTE_SPECIAL_TOKENS,
    Tokenizer,
    build_tokenizer,
    tokenizer_file,
    write_byte_level_tokenizer,
)
from moetrain.errors import ConfigError
from moetrain.model.init import canonical_name
from moetrain.model.layers import rope_permutation
from moetrain.model.transformer import Transformer

QWEN3_MOE, OLMOE = "qwen3_moe", "olmoe"
ARCHITECTURES = {QWEN3_MOE: "Qwen3MoeForCausalLM", OLMOE: "OlmoeForCausalLM"}
SUPPORTED = ", ".join(f"{family} ({cls})" for family, cls in ARCHITECTURES.items())
INDEX_FILE = "model.safetensors.index.json"
# Output files of an export are split at about this size, like save_pretrained's shards.
MAX_FILE_BYTES = 5 * 1024**3

# The architecture fields a Hugging Face directory fixes, with their config.json names (for messages).
ARCH_FIELDS: dict[str, dict[str, str]] = {
    "vocab_size": {QWEN3_MOE: "vocab_size", OLMOE: "vocab_size"},
    "dim": {QWEN3_MOE: "hidden_size", OLMOE: "hidden_size"},
    "n_layers": {QWEN3_MOE: "num_hidden_layers", OLMOE: "num_hidden_layers"},
    "n_heads": {QWEN3_MOE: "num_attention_heads", OLMOE: "num_attention_heads"},
    "n_kv_heads": {QWEN3_MOE: "num_key_value_heads", OLMOE: "num_key_value_heads"},
    "head_dim": {QWEN3_MOE: "head_dim", OLMOE: "hidden_size / num_attention_heads"},
    "n_dense_layers": {QWEN3_MOE: "mlp_only_layers", OLMOE: "(every layer MoE)"},
    "ffn_hidden": {QWEN3_MOE: "intermediate_size", OLMOE: "(no dense layer)"},
    "rope_theta": {QWEN3_MOE: "rope_theta", OLMOE: "rope_theta"},
    "qk_norm": {QWEN3_MOE: "(QK-norm per head)", OLMOE: "(QK-norm over the full width)"},
    "clip_qkv": {QWEN3_MOE: "(no clip_qkv)", OLMOE: "clip_qkv"},
    "norm_eps": {QWEN3_MOE: "rms_norm_eps", OLMOE: "rms_norm_eps"},
    "tie_embeddings": {QWEN3_MOE: "tie_word_embeddings", OLMOE: "tie_word_embeddings"},
    "moe.n_experts": {QWEN3_MOE: "num_experts", OLMOE: "num_experts"},
    "moe.top_k": {QWEN3_MOE: "num_experts_per_tok", OLMOE: "num_experts_per_tok"},
    "moe.expert_hidden": {QWEN3_MOE: "moe_intermediate_size", OLMOE: "intermediate_size"},
    "moe.n_shared_experts": {QWEN3_MOE: "(no shared expert)", OLMOE: "(no shared expert)"},
    "moe.score_func": {QWEN3_MOE: "(softmax router)", OLMOE: "(softmax router)"},
    "moe.renormalize": {QWEN3_MOE: "norm_topk_prob", OLMOE: "norm_topk_prob"},
    "moe.activation": {QWEN3_MOE: "hidden_act", OLMOE: "hidden_act"},
}


# ---------------------------------------------------------------------------------------------
# config.json <-> ModelConfig


def hf_dir(init_from: str) -> Path:
    """The directory of a `model.init_from = "hf:DIR"` value."""
    if not init_from.startswith("hf:") or len(init_from) <= 3:
        raise ConfigError(f"model.init_from = {init_from!r} is invalid: must be 'hf:DIR'")
    return Path(init_from[3:])


def read_hf_config(model_dir: str | Path) -> tuple[str, dict[str, Any]]:
    """(family, config.json contents) of a supported Hugging Face model directory, else a one-line ConfigError."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ConfigError(f"Hugging Face model directory {str(model_dir)!r} does not exist")
    path = model_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path} is missing: {str(model_dir)!r} is not a Hugging Face model directory")
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"{path} is not valid JSON: {err}") from None
    family = hf.get("model_type") if isinstance(hf, dict) else None
    if family not in ARCHITECTURES:
        raise ConfigError(f"{path}: model_type = {family!r} is not a supported family; supported: {SUPPORTED}")
    return family, hf


def _unsupported(where: str, key: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"{where}: {key} = {value!r} is not supported: {why}")


def _rope_theta(hf: dict[str, Any], where: str) -> float:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise _unsupported(where, "rope_type", rope_type, "moetrain computes the default RoPE only")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _num_experts(hf: dict[str, Any]) -> int:
    return int(hf["num_experts"] if "num_experts" in hf else hf["num_local_experts"])


def model_config_from_hf(hf: dict[str, Any], family: str, where: str = "config.json") -> ModelConfig:
    """The moetrain architecture of a Hugging Face config (rope_layout "half": no permutation needed)."""
    try:
        return _model_config_from_hf(hf, family, where)
    except (KeyError, TypeError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"{where}: missing or malformed field {err}") from None


def _model_config_from_hf(hf: dict[str, Any], family: str, where: str) -> ModelConfig:
    for key, ok, why in (
        ("hidden_act", hf.get("hidden_act", "silu") == "silu", "experts and FFNs are SwiGLU (silu)"),
        ("attention_bias", not hf.get("attention_bias", False), "moetrain's projections have no bias"),
        ("attention_dropout", not hf.get("attention_dropout", 0.0), "moetrain has no dropout"),
        ("use_sliding_window", not hf.get("use_sliding_window", False), "moetrain attends to the whole document"),
    ):
        if not ok:
            raise _unsupported(where, key, hf.get(key), why)
    rope_theta = _rope_theta(hf, where)
    dim, n_layers, n_heads = int(hf["hidden_size"]), int(hf["num_hidden_layers"]), int(hf["num_attention_heads"])
    n_kv_heads = int(hf.get("num_key_value_heads") or n_heads)
    n_experts = _num_experts(hf)
    if n_experts < 1:
        raise _unsupported(where, "num_experts", n_experts, "only MoE models are supported")
    common = dict(vocab_size=int(hf["vocab_size"]), dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                  max_seq_len=int(hf.get("max_position_embeddings", 4096)), rope_theta=rope_theta,
                  rope_layout="half", norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                  tie_embeddings=bool(hf.get("tie_word_embeddings", False)))
    moe = dict(n_experts=n_experts, top_k=int(hf["num_experts_per_tok"]), n_shared_experts=0,
               score_func="softmax", renormalize=bool(hf.get("norm_topk_prob", False)), activation="swiglu",
               aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.01)))
    if family == QWEN3_MOE:
        step = int(hf.get("decoder_sparse_step", 1))
        mlp_only = set(hf.get("mlp_only_layers") or [])
        dense = [i for i in range(n_layers) if i in mlp_only or (i + 1) % step != 0]
        if dense != list(range(len(dense))):
            raise _unsupported(where, "mlp_only_layers / decoder_sparse_step", (sorted(mlp_only), step),
                               "moetrain's dense layers must be the first ones (layers 0..k-1)")
        head_dim = int(hf.get("head_dim") or dim // n_heads)
        return ModelConfig(**common, head_dim=head_dim, ffn_hidden=int(hf.get("intermediate_size", 1)),
                           n_dense_layers=len(dense), qk_norm="per_head",
                           moe=MoEConfig(**moe, expert_hidden=int(hf["moe_intermediate_size"])))
    if dim % n_heads:
        raise _unsupported(where, "hidden_size", dim, f"OLMoE needs it divisible by num_attention_heads = {n_heads}")
    if hf.get("head_dim") not in (None, dim // n_heads):
        raise _unsupported(where, "head_dim", hf.get("head_dim"), "OLMoE's head width is hidden_size / heads")
    clip = hf.get("clip_qkv")
    return ModelConfig(**common, head_dim=dim // n_heads, ffn_hidden=int(hf["intermediate_size"]), n_dense_layers=0,
                       qk_norm="full", clip_qkv=float(clip) if clip is not None else None,
                       moe=MoEConfig(**moe, expert_hidden=int(hf["intermediate_size"])))


def architecture(cfg: ModelConfig) -> dict[str, Any]:
    """The fields of `cfg` a Hugging Face directory fixes, with defaults resolved (head_dim, n_kv_heads)."""
    values = {name: getattr(cfg.moe, name[4:]) if name.startswith("moe.") else getattr(cfg, name)
              for name in ARCH_FIELDS}
    values["n_kv_heads"] = cfg.n_kv_heads or cfg.n_heads
    values["head_dim"] = cfg.attention_head_dim()
    if cfg.n_dense_layers == 0:
        values["ffn_hidden"] = None  # unused without dense layers
    return values


def check_architecture(cfg: ModelConfig, model_dir: str | Path) -> tuple[str, dict[str, Any]]:
    """Raise one ConfigError line listing every architecture field where `cfg` and DIR/config.json differ."""
    family, hf = read_hf_config(model_dir)
    where = str(Path(model_dir) / "config.json")
    want = architecture(model_config_from_hf(hf, family, where))
    have = architecture(cfg)
    diffs = []
    for name, value in have.items():
        expected = want[name]
        same = (math.isclose(value, expected, rel_tol=1e-9) if isinstance(value, float) and isinstance(expected, float)
                else value == expected)
        if not same:
            diffs.append(f"model.{name} = {value!r} but {ARCH_FIELDS[name][family]} gives {expected!r}")
    if diffs:
        raise ConfigError(f"model.init_from = 'hf:{model_dir}': the job's architecture differs from {where}: "
                          + "; ".join(diffs))
    return family, hf


def export_family(cfg: ModelConfig) -> str:
    """The Hugging Face family a moetrain architecture is, or one ConfigError line saying what does not fit."""
    moe = cfg.moe
    family = {"per_head": QWEN3_MOE, "full": OLMOE}.get(cfg.qk_norm)
    checks = [
        (family is not None, "model.qk_norm", cfg.qk_norm, "Qwen3-MoE needs 'per_head', OLMoE 'full'"),
        (moe.score_func == "softmax", "model.moe.score_func", moe.score_func, "both families route with softmax"),
        (moe.activation == "swiglu", "model.moe.activation", moe.activation, "both families use SwiGLU experts"),
        (moe.n_shared_experts == 0, "model.moe.n_shared_experts", moe.n_shared_experts, "neither has shared experts"),
        (moe.load_balance != "aux_free", "model.moe.load_balance", moe.load_balance,
         "its expert bias changes the routing and neither family has a place for it"),
        (moe.token_rounding_tile == 1, "model.moe.token_rounding_tile", moe.token_rounding_tile,
         "rounding changes which experts tokens reach; the families route plain top-k"),
    ]
    if family == OLMOE:
        checks += [
            (cfg.n_dense_layers == 0, "model.n_dense_layers", cfg.n_dense_layers, "OLMoE has every layer MoE"),
            (cfg.head_dim in (None, cfg.dim // cfg.n_heads) and cfg.dim % cfg.n_heads == 0, "model.head_dim",
             cfg.head_dim, "OLMoE's head width is model.dim / model.n_heads"),
        ]
    if family == QWEN3_MOE:
        checks.append((cfg.clip_qkv is None, "model.clip_qkv", cfg.clip_qkv, "Qwen3-MoE has no clip_qkv"))
    for ok, name, value, why in checks:
        if not ok:
            raise ConfigError(f"{name} = {value!r} cannot be exported to a Hugging Face family ({SUPPORTED}): {why}")
    return family  # type: ignore[return-value]


def hf_config(cfg: ModelConfig, family: str, tokenizer: Tokenizer, dtype: torch.dtype) -> dict[str, Any]:
    """config.json for a moetrain architecture of `family`, with the tokenizer's special ids."""
    moe = cfg.moe
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[family]], "model_type": family, "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads or cfg.n_heads, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False, "attention_dropout": 0.0, "num_experts": moe.n_experts,
        "num_experts_per_tok": moe.top_k, "norm_topk_prob": moe.renormalize,
        "router_aux_loss_coef": moe.aux_loss_coef, "output_router_logits": False, "initializer_range": 0.02,
        "use_cache": True, "bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id,
        "pad_token_id": tokenizer.pad_id, "dtype": str(dtype).removeprefix("torch."),
    }
    if family == QWEN3_MOE:
        out.update(head_dim=cfg.attention_head_dim(), intermediate_size=cfg.ffn_hidden,
                   moe_intermediate_size=moe.expert_hidden, decoder_sparse_step=1,
                   mlp_only_layers=list(range(cfg.n_dense_layers)), use_sliding_window=False, sliding_window=None)
    else:
        out.update(intermediate_size=moe.expert_hidden, clip_qkv=cfg.clip_qkv)
    return out


# ---------------------------------------------------------------------------------------------
# Tensor names and shapes


def direct_names(cfg: ModelConfig) -> dict[str, str]:
    """moetrain parameter name -> Hugging Face name, for every parameter that is not a routed expert."""
    names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not cfg.tie_embeddings:
        names["output.weight"] = "lm_head.weight"
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}", f"model.layers.{i}"
        for a, b in (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj")):
            names[f"{ours}.attention.{a}.weight"] = f"{theirs}.self_attn.{b}.weight"
        if cfg.qk_norm != "none":
            names[f"{ours}.attention.q_norm.weight"] = f"{theirs}.self_attn.q_norm.weight"
            names[f"{ours}.attention.k_norm.weight"] = f"{theirs}.self_attn.k_norm.weight"
        names[f"{ours}.attention_norm.weight"] = f"{theirs}.input_layernorm.weight"
        names[f"{ours}.ffn_norm.weight"] = f"{theirs}.post_attention_layernorm.weight"
        if i < cfg.n_dense_layers:
            for a, b in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
                names[f"{ours}.feed_forward.{a}.weight"] = f"{theirs}.mlp.{b}.weight"
        else:
            names[f"{ours}.moe.router.weight"] = f"{theirs}.mlp.gate.weight"
    return names


def expert_names(layer: int, expert: int) -> tuple[str, str, str]:
    """Per-expert Hugging Face names (gate_proj [n, d], up_proj [n, d], down_proj [d, n]), as save_pretrained writes."""
    base = f"model.layers.{layer}.mlp.experts.{expert}"
    return f"{base}.gate_proj.weight", f"{base}.up_proj.weight", f"{base}.down_proj.weight"


def fused_expert_names(layer: int) -> tuple[str, str]:
    """transformers 5's in-memory expert names: gate_up_proj [E, 2n, d] and down_proj [E, d, n]."""
    base = f"model.layers.{layer}.mlp.experts"
    return f"{base}.gate_up_proj", f"{base}.down_proj"


def expected_shapes(cfg: ModelConfig, fused_layers: set[int] = frozenset()) -> dict[str, tuple[int, ...]]:
    """Every tensor a directory of this architecture holds, with its shape (per-expert layout except `fused_layers`)."""
    d, hd, heads, kv = cfg.dim, cfg.attention_head_dim(), cfg.n_heads, cfg.n_kv_heads or cfg.n_heads
    n, n_experts = cfg.moe.expert_hidden, cfg.moe.n_experts
    norm = {"per_head": (hd, hd), "full": (heads * hd, kv * hd), "none": (0, 0)}[cfg.qk_norm]
    by_suffix = {"q_proj.weight": (heads * hd, d), "k_proj.weight": (kv * hd, d), "v_proj.weight": (kv * hd, d),
                 "o_proj.weight": (d, heads * hd), "q_norm.weight": (norm[0],), "k_norm.weight": (norm[1],),
                 "layernorm.weight": (d,), "mlp.gate.weight": (n_experts, d),
                 "mlp.gate_proj.weight": (cfg.ffn_hidden, d), "mlp.up_proj.weight": (cfg.ffn_hidden, d),
                 "mlp.down_proj.weight": (d, cfg.ffn_hidden)}
    shapes: dict[str, tuple[int, ...]] = {}
    for name in direct_names(cfg).values():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            shapes[name] = (cfg.vocab_size, d)
        elif name == "model.norm.weight":
            shapes[name] = (d,)
        else:
            shapes[name] = next(shape for suffix, shape in by_suffix.items() if name.endswith(suffix))
    for layer in range(cfg.n_dense_layers, cfg.n_layers):
        if layer in fused_layers:
            gate_up, down = fused_expert_names(layer)
            shapes[gate_up], shapes[down] = (n_experts, 2 * n, d), (n_experts, d, n)
            continue
        for e in range(n_experts):
            gate, up, down = expert_names(layer, e)
            shapes[gate], shapes[up], shapes[down] = (n, d), (n, d), (d, n)
    return shapes


def stored_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the directory's safetensors files (headers only)."""
    try:
        from safetensors import safe_open
    except ImportError:
        raise ConfigError("Hugging Face model directories need the `safetensors` package, which is not installed; "
                          "install the extra `pip install moetrain[hf]`") from None
    files = sorted(model_dir.glob("*.safetensors"))
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            listed = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, AttributeError):
            raise ConfigError(f"{index} is not a valid safetensors index (no weight_map)") from None
        missing = sorted(listed - {f.name for f in files})
        if missing:
            raise ConfigError(f"{index} lists {missing[0]}, which is missing from {model_dir}")
    if not files:
        pickled = [p.name for p in model_dir.glob("*.bin")]
        hint = (f" (it has {pickled[0]}: pickle files are never loaded; convert them to safetensors)" if pickled
                else "")
        raise ConfigError(f"{model_dir} has no *.safetensors weight files{hint}")
    shapes = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():
                    shapes[key] = tuple(handle.get_slice(key).get_shape())
        except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
            raise ConfigError(f"{path} is not a readable safetensors file: {str(err).splitlines()[0]}") from None
    return shapes


def _check_stored(cfg: ModelConfig, model_dir: Path) -> set[int]:
    """Check the files hold exactly the architecture's tensors; return the MoE layers stored fused."""
    stored = stored_shapes(model_dir)
    fused = {layer for layer in range(cfg.n_dense_layers, cfg.n_layers) if fused_expert_names(layer)[0] in stored}
    want = expected_shapes(cfg, fused)
    missing = [name for name in want if name not in stored]
    if missing:
        raise ConfigError(f"{model_dir}: tensor {missing[0]} is missing from its safetensors files"
                          + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    for name, shape in want.items():
        if stored[name] != shape:
            raise ConfigError(f"{model_dir}: tensor {name} has shape {list(stored[name])}, config.json implies "
                              f"{list(shape)}")
    unexpected = sorted(set(stored) - set(want))
    if unexpected:
        raise ConfigError(f"{model_dir}: tensor {unexpected[0]} is not part of the architecture in config.json "
                          f"(an unsupported option?)" + (f" (and {len(unexpected) - 1} more)"
                                                         if len(unexpected) > 1 else ""))
    return fused


# ---------------------------------------------------------------------------------------------
# Shard-local tensor helpers (plain tensors and FSDP's DTensors alike)


def _local_view(t: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    """(local tensor, its offset in the global tensor)."""
    if isinstance(t, DTensor):
        _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        return t.to_local(), tuple(offset)
    return t, (0,) * t.dim()


def _by_rows(t: Tensor) -> Tensor:
    """`t` laid out so that every rank holds whole rows (whole experts) of dim 0.

    FSDP shards dim 0 already; expert parallelism may have FSDP shard an expert block on dim 1
    (`moetrain.parallel.shard`), and then the same values are redistributed with those shards
    gathered (a collective: every rank calls it in the same order). Each rank then holds only
    its own experts, whole.
    """
    if not isinstance(t, DTensor) or all(not isinstance(p, Shard) or p.dim == 0 for p in t.placements):
        return t
    rows = [p if isinstance(p, Shard) and p.dim == 0 else Replicate() for p in t.placements]
    return t.redistribute(t.device_mesh, rows)


def _local_rows(t: Tensor) -> tuple[Tensor, int]:
    """(local tensor, first global row) of a tensor sharded, if at all, along dim 0 only (see `_by_rows`)."""
    if isinstance(t, DTensor) and any(isinstance(p, Shard) and p.dim != 0 for p in t.placements):
        raise ValueError(f"expected sharding along dim 0, got placements {t.placements}")
    local, offset = _local_view(t)
    return local, offset[0]


def _full(t: Tensor) -> Tensor:
    """The whole tensor (a collective for a DTensor: every rank must call it in the same order)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _copy_full_into(param: Tensor, full: Tensor) -> None:
    local, offset = _local_view(param)
    local.copy_(full[tuple(slice(o, o + s) for o, s in zip(offset, local.shape, strict=True))])


def _rows_like(t: Tensor, shape: tuple[int, ...]) -> Tensor:
    """An empty tensor of `shape`, sharded along dim 0 exactly like `t` (whose dim 0 has the same length)."""
    local, _ = _local_view(t)
    buffer = torch.empty((local.shape[0], *shape[1:]), dtype=local.dtype, device=local.device)
    if not isinstance(t, DTensor):
        return buffer
    return DTensor.from_local(buffer, t.device_mesh, t.placements, run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


def _rope_reorder(t: Tensor, head_dim: int, order: Tensor) -> Tensor:
    """Reorder the channels of every head along dim 0 of a q/k projection or QK-norm weight."""
    return t.reshape(-1, head_dim, *t.shape[1:])[:, order.to(t.device)].reshape(t.shape)


def _needs_rope_reorder(cfg: ModelConfig, name: str) -> bool:
    return cfg.rope_layout == "interleaved" and name.endswith(
        ("attention.wq.weight", "attention.wk.weight", "attention.q_norm.weight", "attention.k_norm.weight"))


def _parameters(model: nn.Module) -> dict[str, Tensor]:
    return {canonical_name(name): param for name, param in model.named_parameters()}


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed() and dist.get_world_size() > 1:
        dist.barrier()


@contextmanager
def _quiet_single_process():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# ---------------------------------------------------------------------------------------------
# Import


def load_hf_weights(model: nn.Module, init_from: str | Path) -> None:
    """Fill `model` (plain or FSDP/HSDP-sharded, any layout) with a Hugging Face directory's weights.

    `init_from` is "hf:DIR" or DIR. The job's architecture must match DIR/config.json and the files
    must hold exactly its tensors (one-line ConfigError naming the difference). Collective when
    the model is sharded: every rank calls it; each reads only its own slices and experts.
    """
    model_dir = hf_dir(init_from) if isinstance(init_from, str) and init_from.startswith("hf:") else Path(init_from)
    cfg: ModelConfig = model.cfg
    check_architecture(cfg, model_dir)
    fused = _check_stored(cfg, model_dir)
    state, finish = _import_targets(model, cfg, fused)
    with _quiet_single_process():
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(model_dir)), no_dist=not _distributed())
    with torch.no_grad():
        for step in finish:
            step()


def _import_targets(model: nn.Module, cfg: ModelConfig, fused: set[int]) -> tuple[dict[str, Tensor],
                                                                                 list[Callable[[], None]]]:
    """HF name -> tensor DCP fills in place, and the copies that then move buffered values into parameters."""
    params = _parameters(model)
    head_dim, n = cfg.attention_head_dim(), cfg.moe.expert_hidden
    order = rope_permutation(head_dim)  # half -> interleaved
    state: dict[str, Tensor] = {}
    finish: list[Callable[[], None]] = []

    def reorder_into(param: Tensor, buffer: Tensor) -> Callable[[], None]:
        return lambda: _copy_full_into(param, _rope_reorder(_full(buffer), head_dim, order))

    def fused_into(local_w1: Tensor, local_w2: Tensor, gate_up: Tensor, down: Tensor) -> Callable[[], None]:
        def copy() -> None:
            local_w1.copy_(_local_view(gate_up)[0].transpose(1, 2))
            local_w2.copy_(_local_view(down)[0].transpose(1, 2))
        return copy

    def expert_into(local_w1: Tensor, local_w2: Tensor, row: int, gate: Tensor, up: Tensor,
                    down: Tensor) -> Callable[[], None]:
        def copy() -> None:
            local_w1[row, :, :n].copy_(gate.T)
            local_w1[row, :, n:].copy_(up.T)
            local_w2[row].copy_(down.T)
        return copy

    for ours, theirs in direct_names(cfg).items():
        param = params[ours].detach()
        if _needs_rope_reorder(cfg, ours):
            state[theirs] = torch.empty_like(param)
            finish.append(reorder_into(param, state[theirs]))
        else:
            state[theirs] = param  # read straight into the (local shard of the) parameter
    def back_into(param: Tensor, rows: Tensor) -> Callable[[], None]:
        return lambda: _local_view(param)[0].copy_(rows.redistribute(param.device_mesh, param.placements).to_local())

    for layer in range(cfg.n_dense_layers, cfg.n_layers):
        w1_param = params[f"layers.{layer}.moe.experts.w1"].detach()
        w2_param = params[f"layers.{layer}.moe.experts.w2"].detach()
        w1, w2 = _by_rows(w1_param), _by_rows(w2_param)  # the parameters themselves unless sharded on dim 1
        local_w1, first = _local_rows(w1)
        local_w2, _ = _local_rows(w2)
        if layer in fused:
            gate_up_name, down_name = fused_expert_names(layer)
            state[gate_up_name] = _rows_like(w1, (cfg.moe.n_experts, 2 * n, cfg.dim))
            state[down_name] = _rows_like(w2, (cfg.moe.n_experts, cfg.dim, n))
            finish.append(fused_into(local_w1, local_w2, state[gate_up_name], state[down_name]))
        else:
            for row in range(local_w1.shape[0]):  # only the experts this rank holds
                names = expert_names(layer, first + row)
                gate, up = local_w1.new_empty(n, cfg.dim), local_w1.new_empty(n, cfg.dim)
                down = local_w2.new_empty(cfg.dim, n)
                state.update(zip(names, (gate, up, down), strict=True))
                finish.append(expert_into(local_w1, local_w2, row, gate, up, down))
        for param, rows in ((w1_param, w1), (w2_param, w2)):
            if rows is not param:
                finish.append(back_into(param, rows))
    return state, finish


def load_hf(model_dir: str | Path, device: torch.device | str = "cpu") -> tuple[Transformer, JobConfig]:
    """(model, JobConfig) of a Hugging Face directory, in one process: the architecture from config.json
    (RoPE kept in the "half" layout), the weights from the safetensors files, the directory's
    tokenizer.json as `data.tokenizer` when it has one."""
    model_dir = Path(model_dir)
    family, hf = read_hf_config(model_dir)
    model_cfg = replace(model_config_from_hf(hf, family, str(model_dir / "config.json")), init_from=f"hf:{model_dir}")
    cfg = JobConfig(model=model_cfg)
    cfg.data.seq_len = min(cfg.data.seq_len, model_cfg.max_seq_len)
    cfg.data.tokenizer = str(model_dir) if (model_dir / "tokenizer.json").is_file() else "byte"
    cfg.validate()
    with torch.device("meta"):
        model = Transformer(cfg.model)
    model.to_empty(device=device)
    for module in model.modules():  # weights come from the files; only the balancing buffers need a value
        reset = getattr(module, "reset_buffers", None)
        if callable(reset):
            reset()
    load_hf_weights(model, model_dir)
    return model, cfg


# ---------------------------------------------------------------------------------------------
# Export


def _file_index(shapes: dict[str, tuple[int, ...]], element_size: int, max_file_bytes: int) -> dict[str, int]:
    """Tensor name -> output file number (from 1), in order, starting a new file past max_file_bytes."""
    index, file_number, used = {}, 1, 0
    for name, shape in shapes.items():
        size = math.prod(shape) * element_size
        if used and used + size > max_file_bytes:
            file_number, used = file_number + 1, 0
        index[name] = file_number
        used += size
    return index


def _export_tensors(model: nn.Module, cfg: ModelConfig, dtype: torch.dtype) -> dict[str, Tensor]:
    """HF name -> tensor to write: DTensor shards as they are, this rank's experts as whole tensors."""
    params = _parameters(model)
    head_dim, n = cfg.attention_head_dim(), cfg.moe.expert_hidden
    order = torch.argsort(rope_permutation(head_dim))  # interleaved -> half
    state: dict[str, Tensor] = {}
    for ours, theirs in direct_names(cfg).items():
        tensor = params[ours].detach()
        if _needs_rope_reorder(cfg, ours):
            tensor = _rope_reorder(_full(tensor), head_dim, order)
        state[theirs] = tensor.to(dtype)
    for layer in range(cfg.n_dense_layers, cfg.n_layers):
        local_w1, first = _local_rows(_by_rows(params[f"layers.{layer}.moe.experts.w1"].detach()))
        local_w2, _ = _local_rows(_by_rows(params[f"layers.{layer}.moe.experts.w2"].detach()))
        for row in range(local_w1.shape[0]):
            gate, up, down = expert_names(layer, first + row)
            state[gate] = local_w1[row, :, :n].T.contiguous().to(dtype)
            state[up] = local_w1[row, :, n:].T.contiguous().to(dtype)
            state[down] = local_w2[row].T.contiguous().to(dtype)
    return state


def check_output_dir(out_dir: str | Path) -> Path:
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {str(out)!r} already exists and is not an empty directory; choose a new one")
    return out


def save_hf(model: nn.Module, cfg: JobConfig, out_dir: str | Path, dtype: torch.dtype | None = None,
            max_file_bytes: int = MAX_FILE_BYTES) -> Path:
    """Write `model` (plain or FSDP/HSDP-sharded) as a Hugging Face directory that `from_pretrained` loads.

    Writes model-XXXXX-of-YYYYY.safetensors + model.safetensors.index.json (per-expert tensors, as
    save_pretrained does), config.json and the run's tokenizer (tokenizer.json, tokenizer_config.json;
    the byte tokenizer as an equivalent byte-level tokenizer.json). `dtype` defaults to the parameters'.
    Collective when the model is sharded: each rank writes its own shards, rank 0 then assembles the
    files one tensor at a time.
    """
    family = export_family(cfg.model)
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"data.tokenizer = {cfg.data.tokenizer!r} has {tokenizer.vocab_size} ids, more than "
                          f"model.vocab_size = {cfg.model.vocab_size}: the exported directory would not be usable")
    out = check_output_dir(out_dir)
    rank = _rank()
    dtype = dtype or next(model.parameters()).dtype
    state = _export_tensors(model, cfg.model, dtype)
    shapes = expected_shapes(cfg.model)
    index = _file_index(shapes, torch.empty((), dtype=dtype).element_size(), max_file_bytes)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    _barrier()
    if _distributed():
        writer = HuggingFaceStorageWriter(str(out), fqn_to_index_mapping=index, save_distributed=True,
                                          enable_consolidation=True)
        dcp.save(state, storage_writer=writer)
        _barrier()
        if rank == 0:
            shutil.rmtree(out / "sharded", ignore_errors=True)  # the per-rank pieces, now consolidated
    else:
        with _quiet_single_process():
            dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(out), fqn_to_index_mapping=index),
                     no_dist=True)
    if rank == 0:
        (out / "config.json").write_text(json.dumps(hf_config(cfg.model, family, tokenizer, dtype), indent=2) + "\n")
        _write_tokenizer(cfg.data.tokenizer, tokenizer, out)
    _barrier()
    return out


def _write_tokenizer(spec: str, tokenizer: Tokenizer, out: Path) -> None:
    source = tokenizer_file(spec)
    if source is None:
        write_byte_level_tokenizer(out / "tokenizer.json")
        names = dict(zip(("bos_token", "eos_token", "pad_token"), BYTE_SPECIAL_TOKENS, strict=True))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **names, "model_max_length": 1 << 30}
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        return
    shutil.copyfile(source, out / "tokenizer.json")
    for extra in ("tokenizer_config.json", "special_tokens_map.json"):
        if (source.parent / extra).is_file():
            shutil.copyfile(source.parent / extra, out / extra)
