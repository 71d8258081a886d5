"""The [model] section: the transformer's shape, attention, RoPE and init, and their own checks.

Rules among [model] and [model.moe] fields live here; one that also reads another section (the
tokenizer a model directory carries, data.seq_len, parallel.ep) is JobConfig's. No parsing, no I/O.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Literal

from moetrain.config.checks import check, check_nonnegative, check_positive
from moetrain.config.moe import MoEConfig

# The names of moetrain.model.init's catalog (a test checks the two agree), typed here so
# that a config is validated without importing the model.
InitScheme = Literal["llama", "gpt-oss", "depth-total", "olmo-normal", "olmo-mitchell", "olmo-megatron", "gpt2",
                     "megatron", "neox"]


@dataclass
class ModelConfig:
    vocab_size: int = 259
    """Token vocabulary size (259 = the byte tokenizer's 256 bytes and 3 special tokens)."""
    dim: int = 256
    """Model (residual stream) width."""
    n_layers: int = 4
    """Transformer blocks."""
    n_heads: int = 4
    """Query heads."""
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); None = n_heads."""
    head_dim: int | None = None
    """Width of one attention head; None = dim // n_heads (Qwen3-MoE sets it freely, e.g. 128 at dim 2048, 32 heads)."""
    ffn_hidden: int = 512
    """Hidden width of the dense SwiGLU FFN of the first n_dense_layers blocks."""
    n_dense_layers: int = 1
    """The first n_dense_layers blocks use a dense SwiGLU FFN; the rest are MoE (DeepSeek style)."""
    max_seq_len: int = 512
    """Longest sequence the RoPE tables are built for."""
    rope_theta: float = 10000.0
    """RoPE base frequency."""
    rope_layout: Literal["interleaved", "half"] = "interleaved"
    """Which channels RoPE rotates together: (2j, 2j+1) "interleaved" (torchtitan, Meta Llama) or
    (j, j + head_dim/2) "half" (Hugging Face's rotate_half). The same function up to a fixed
    permutation of the q/k projection rows, which the Hugging Face conversion applies."""
    qk_norm: Literal["none", "per_head", "full"] = "none"
    """RMSNorm on queries and keys before RoPE: over each head's channels (Qwen3) or over the whole
    projected width (OLMoE)."""
    attention: Literal["auto", "dense", "segments", "flex"] = "auto"
    """Document-masked attention (moetrain.model.attention): "auto" = flex attention on CUDA, per-document
    SDPA ("segments") on CPU when the documents make it cheaper; "dense" = the S×S mask (reference)."""
    clip_qkv: float | None = None
    """Clamp q, k and v to [-clip_qkv, clip_qkv] after the projections (and QK-norm); None = off (OLMoE option)."""
    attention_bias: Literal["none", "qkv", "all"] = "none"
    """Biases on the attention projections: none; on q, k and v (Qwen2-MoE, GLM-4.5); or on q, k, v and
    the output projection (GPT-OSS)."""
    attention_sinks: bool = False
    """A learned logit per query head that joins every softmax's denominator and carries no value (GPT-OSS)."""
    sliding_window: int | None = None
    """Keys a query of a sliding-window layer sees, itself included (query i sees keys j > i - sliding_window
    of its own document); None = no sliding window."""
    layer_types: list[Literal["full_attention", "sliding_attention"]] | None = None
    """Per layer, whether it attends within model.sliding_window or to its whole document (transformers'
    layer_types; GPT-OSS alternates them). None = every layer sliding when sliding_window is set (Mixtral)."""
    partial_rotary_factor: float = 1.0
    """Share of each head's channels RoPE rotates, the first int(head_dim * factor) ones (GLM-4.5:
    0.5; the "half" rope_layout only); the rest carry no position. 1 = every channel."""
    rope_scaling: Literal["none", "yarn"] = "none"
    """RoPE frequency scaling: none, or YaRN (arXiv 2309.00071) as DeepSeek-V3 ships it (the rope_yarn_* fields)."""
    rope_yarn_factor: float = 1.0
    """YaRN: context extension factor (interpolated frequencies are divided by it)."""
    rope_yarn_original_max_seq_len: int = 4096
    """YaRN: the context length the model was pre-trained at (original_max_position_embeddings)."""
    rope_yarn_beta_fast: float = 32.0
    """YaRN: rotations bounding the extrapolated (unscaled) high frequencies."""
    rope_yarn_beta_slow: float = 1.0
    """YaRN: rotations bounding the interpolated low frequencies."""
    rope_yarn_mscale: float = 0.0
    """YaRN: cos/sin are multiplied by mscale(factor, rope_yarn_mscale) / mscale(factor, rope_yarn_mscale_all_dim)
    when both are non-zero, else by mscale(factor, 1), where mscale(s, m) = 0.1 · m · ln s + 1 (0 = unset)."""
    rope_yarn_mscale_all_dim: float = 0.0
    """YaRN: MLA multiplies its softmax scale by mscale(factor, this)^2 when non-zero (DeepSeek-V3: 1)."""
    rope_yarn_truncate: bool = True
    """YaRN: round the correction range outwards to whole channels (Hugging Face's default)."""
    kv_lora_rank: int | None = None
    """Multi-head latent attention (MLA, DeepSeek-V2/V3) when set: keys and values come from one shared
    latent of this width (RMSNorm-ed), and one RoPE key part is shared by every head. None = the
    grouped-query attention above (n_kv_heads, head_dim, qk_norm, clip_qkv then do not apply)."""
    q_lora_rank: int | None = None
    """MLA: queries go through a low-rank path of this width with its own RMSNorm; None = one full query
    projection (DeepSeek-V2-Lite, Moonlight)."""
    qk_nope_head_dim: int = 128
    """MLA: per-head query/key channels without position (from the latent)."""
    qk_rope_head_dim: int = 64
    """MLA: per-head query channels with RoPE, and the width of the one RoPE key part all heads share."""
    v_head_dim: int = 128
    """MLA: per-head value width."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    tie_embeddings: bool = False
    """Share the token embedding and the output projection."""
    init_scheme: InitScheme = "llama"
    """Initialization scheme (docs/design/init.md)."""
    init_scale_embedding: bool = False
    """olmo-megatron only: embedding std init_std·sqrt(dim) instead of init_std (OLMo's `scale_emb_init`)."""
    init_from: str | None = None
    """Start from a Hugging Face model directory ("hf:DIR"): weights from its safetensors; the architecture
    fields the TOML and options leave unset come from its config.json (and data.tokenizer from its
    tokenizer.json), those set must agree with it (moetrain.interop.config_map). None = init_scheme."""
    mtp_depth: int = 0
    """Multi-token-prediction modules after the last block (DeepSeek-V3's MTP, `num_nextn_predict_layers`):
    module k (1..mtp_depth) predicts the token k + 1 ahead from module k - 1's hidden state and the embedding
    of the token k ahead, with one block of the model's kind and the shared embedding and head
    (moetrain.model.mtp); trained with weight train.mtp_loss_weight. 0 = none."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """The MoE layers."""

    def attention_head_dim(self) -> int:
        """model.head_dim, or dim // n_heads when it is None."""
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads

    def window_of(self, layer: int) -> int | None:
        """The sliding window of block `layer`, or None where it attends to its whole document."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def attention_kind(self) -> str:
        """"mla" (multi-head latent attention, kv_lora_rank set) or "gqa"; what a Hugging Face family keys on."""
        return "mla" if self.kv_lora_rank is not None else "gqa"

    def rotary_dim(self) -> int:
        """Channels of each query/key head RoPE rotates: MLA's qk_rope_head_dim, else the partial_rotary_factor
        share of the head width."""
        if self.kv_lora_rank is not None:
            return self.qk_rope_head_dim
        return int(self.attention_head_dim() * self.partial_rotary_factor)

    def validate(self) -> None:
        """Raise ConfigError (one line) at the first invalid [model] or [model.moe] field."""
        check_positive(self, "model", ("vocab_size", "dim", "n_layers", "n_heads", "ffn_hidden", "max_seq_len"))
        check_nonnegative(self, "model", ("n_dense_layers", "mtp_depth"))
        check(self.rope_theta > 0, "model.rope_theta", self.rope_theta, "must be > 0")
        self._validate_attention_variants()
        check(self.norm_eps > 0, "model.norm_eps", self.norm_eps, "must be > 0")
        self._validate_heads()
        if self.init_from is not None:
            check(self.init_from.startswith("hf:") and len(self.init_from) > 3, "model.init_from", self.init_from,
                  "must be 'hf:DIR' (a Hugging Face model directory) or None")
        if self.n_kv_heads is not None:
            check(self.n_kv_heads >= 1 and self.n_heads % self.n_kv_heads == 0, "model.n_kv_heads", self.n_kv_heads,
                  f"must be a positive divisor of model.n_heads = {self.n_heads}")
        check(self.n_dense_layers <= self.n_layers, "model.n_dense_layers", self.n_dense_layers,
              f"must be <= model.n_layers = {self.n_layers}")
        if self.sliding_window is not None:
            check(self.sliding_window >= 1, "model.sliding_window", self.sliding_window, "must be >= 1 or None (off)")
        if self.layer_types is not None:
            check(len(self.layer_types) == self.n_layers, "model.layer_types", self.layer_types,
                  f"must name one type per layer (model.n_layers = {self.n_layers}) or be None")
            check(self.sliding_window is not None or "sliding_attention" not in self.layer_types, "model.layer_types",
                  self.layer_types, "has sliding_attention layers but model.sliding_window is None")
        if self.mtp_depth > 0:
            check(self.layer_types is None, "model.mtp_depth", self.mtp_depth,
                  "multi-token-prediction blocks have no entry in model.layer_types; set it to None or mtp_depth to 0")
        self.moe.validate()
        moe = self.moe
        # One renormalised gate is g / g = 1 whatever the router says: the LM loss would never train it.
        check(not (moe.top_k == 1 and moe.renormalize and self.n_dense_layers < self.n_layers),
              "model.moe.renormalize", moe.renormalize,
              "with model.moe.top_k = 1 every gate is exactly 1, so the router gets no gradient from "
              "the language-model loss; set model.moe.renormalize = False (Switch's gate) or model.moe.top_k >= 2")
        schemes = typing.get_args(InitScheme)
        check(self.init_scheme in schemes, "model.init_scheme", self.init_scheme,
              f"valid schemes: {', '.join(schemes)}")
        check(not self.init_scale_embedding or self.init_scheme == "olmo-megatron", "model.init_scale_embedding",
              self.init_scale_embedding,
              f"only the 'olmo-megatron' scheme has it (model.init_scheme = {self.init_scheme!r})")

    def _validate_heads(self) -> None:
        """Head widths (RoPE rotates channel pairs) and query/key clipping."""
        if self.kv_lora_rank is not None:
            pass  # multi-head latent attention has widths of its own (checked in _validate_attention_variants)
        elif self.head_dim is None:
            check(self.dim % self.n_heads == 0, "model.n_heads", self.n_heads,
                  f"must divide model.dim = {self.dim} (or set model.head_dim)")
            check((self.dim // self.n_heads) % 2 == 0, "model.n_heads", self.n_heads,
                  f"head dim model.dim / model.n_heads = {self.dim / self.n_heads:g} must be even for RoPE")
        else:
            check(self.head_dim >= 2 and self.head_dim % 2 == 0, "model.head_dim", self.head_dim,
                  "must be a positive even integer (RoPE rotates channel pairs) or None")
        if self.clip_qkv is not None:
            check(self.clip_qkv > 0, "model.clip_qkv", self.clip_qkv, "must be > 0 or None")

    def _validate_attention_variants(self) -> None:
        """Partial rotary, YaRN and multi-head latent attention fields."""
        check(0 < self.partial_rotary_factor <= 1, "model.partial_rotary_factor", self.partial_rotary_factor,
              "must be in (0, 1]")
        if self.partial_rotary_factor < 1:
            check(self.rope_layout == "half", "model.partial_rotary_factor", self.partial_rotary_factor,
                  "partial rotary is computed in the 'half' RoPE layout only "
                  f"(model.rope_layout = {self.rope_layout!r})")
            check(self.rotary_dim() >= 2 and self.rotary_dim() % 2 == 0, "model.partial_rotary_factor",
                  self.partial_rotary_factor,
                  f"must rotate an even number of channels >= 2 (head_dim = {self.attention_head_dim()})")
        # The YaRN and MLA widths are checked whether or not they are in use: a value no model can have is a
        # mistake even where it is ignored today (it would silently apply once rope_scaling or MLA is set).
        check(self.rope_yarn_factor >= 1, "model.rope_yarn_factor", self.rope_yarn_factor, "must be >= 1")
        check(self.rope_yarn_original_max_seq_len >= 1, "model.rope_yarn_original_max_seq_len",
              self.rope_yarn_original_max_seq_len, "must be a positive integer")
        for name in ("rope_yarn_beta_fast", "rope_yarn_beta_slow"):
            check(getattr(self, name) > 0, f"model.{name}", getattr(self, name), "must be > 0")
        check_nonnegative(self, "model", ("rope_yarn_mscale", "rope_yarn_mscale_all_dim"))
        for name in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if value is not None:
                check(value >= 1, f"model.{name}", value, "must be a positive integer")
        check(self.qk_rope_head_dim >= 2 and self.qk_rope_head_dim % 2 == 0, "model.qk_rope_head_dim",
              self.qk_rope_head_dim, "must be a positive even integer (RoPE rotates channel pairs)")
        if self.kv_lora_rank is not None:
            check(self.attention_bias == "none", "model.attention_bias", self.attention_bias,
                  "MLA (model.kv_lora_rank set) has no projection biases")
            check(not self.attention_sinks and self.sliding_window is None, "model.kv_lora_rank", self.kv_lora_rank,
                  "MLA is not combined with attention sinks or sliding windows")
            check(self.partial_rotary_factor == 1, "model.partial_rotary_factor", self.partial_rotary_factor,
                  "MLA rotates its qk_rope_head_dim channels; leave it at 1")
