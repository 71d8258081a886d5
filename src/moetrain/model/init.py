"""Catalog of cited initialization schemes, applied shard-locally and deterministically.

A scheme is data: a table from parameter *kind* (embedding, qkv, attn_out, ffn_gate, ffn_up,
ffn_down, router, expert_gate, expert_up, expert_down, lm_head, norm) to a `Rule` (normal,
truncated normal with a cutoff, ones, zeros; std as a function of d, L, layer index and FFN width).
`classify` maps a parameter name of `moetrain.model.transformer.Transformer` to kinds; the fused
expert weight `experts.w1` [E, d, 2n] is split along its last dim into a gate half and an up half,
which get their own rules (torchtitan's llama init gives them different stds).

Sharding: every value is a function of (seed, parameter name, global index) only. Values are
drawn on the CPU in fixed blocks of rows along dim 0, each block from its own generator seeded by
a hash of (seed, name, segment, block); a rank holding a DTensor shard draws just the blocks that
overlap its shard (offsets from the DTensor placements) and copies its slice. So a sharded init
equals the unsharded one bit for bit, on any number of ranks, without communication. Costs: at
most two partly wasted blocks per shard, and a host-to-device copy when parameters live on a GPU.

`init_model` is what `Transformer.init_weights` calls. This module works on any module with the
Transformer's parameter names and `cfg`; it never imports or builds the model (init_report.py
does, for the `moetrain init-report` command), never builds a process group (it only reads DTensor
metadata) and has no command-line code. The scheme names are repeated in `moetrain.config.model.InitScheme`
so a config validates without importing the model; a test keeps the two in step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from moetrain.config.model import ModelConfig
from moetrain.errors import ModelError

KINDS = ("embedding", "qkv", "attn_out", "ffn_gate", "ffn_up", "ffn_down", "router",
         "expert_gate", "expert_up", "expert_down", "lm_head", "norm")
Kind = Literal["embedding", "qkv", "attn_out", "ffn_gate", "ffn_up", "ffn_down", "router",
               "expert_gate", "expert_up", "expert_down", "lm_head", "norm"]
Dist = Literal["normal", "trunc_normal", "ones", "zeros"]

# Biases (attention projections, router, experts) and attention sinks start at zero in every scheme:
# the cited sources zero every bias; a zero sink is one extra zero logit in each softmax.
BIAS_KIND = "bias"

# Rows of a parameter drawn from one generator: large enough to amortise generator setup,
# small enough that a shard wastes little. Changing it changes every initial value.
BLOCK_NUMEL = 1 << 16


@dataclass(frozen=True)
class Dims:
    """What a std formula may depend on: d (model dim), L (layers), l (layer index from 0, None
    outside blocks) and n_ff (hidden width of the FFN or expert the parameter belongs to)."""

    d: int
    L: int
    l: int | None = None  # noqa: E741 - the papers' name for the layer index
    n_ff: int | None = None


@dataclass(frozen=True)
class Rule:
    """One distribution. `formula` is the std written out for reports and docs."""

    dist: Dist
    formula: str = ""
    sigma: Callable[[Dims], float] = lambda dims: 0.0
    cutoff_sigmas: float | None = None  # truncate at ±cutoff_sigmas·σ
    cutoff_abs: float | None = None  # truncate at ±cutoff_abs (absolute units, torch's default a=-2, b=2)

    def cutoff(self, dims: Dims) -> float | None:
        if self.dist != "trunc_normal":
            return None
        if self.cutoff_sigmas is not None:
            return self.cutoff_sigmas * self.sigma(dims)
        return self.cutoff_abs

    def target_std(self, dims: Dims) -> float:
        """Exact std of the distribution drawn (a truncated normal is narrower than its σ)."""
        if self.dist in ("ones", "zeros"):
            return 0.0
        sigma = self.sigma(dims)
        cutoff = self.cutoff(dims)
        if cutoff is None:
            return sigma
        alpha = cutoff / sigma
        mass = math.erf(alpha / math.sqrt(2))  # P(|z| < alpha)
        density = math.exp(-alpha * alpha / 2) / math.sqrt(2 * math.pi)
        return sigma * math.sqrt(max(1.0 - 2 * alpha * density / mass, 0.0))

    def target_mean(self) -> float:
        return 1.0 if self.dist == "ones" else 0.0

    def describe(self, dims: Dims) -> str:
        if self.dist in ("ones", "zeros"):
            return self.dist
        text = f"{self.dist}(std={self.formula})"
        if self.dist == "trunc_normal":
            text += f" cut ±{self.cutoff_sigmas:g}σ" if self.cutoff_sigmas is not None else f" cut ±{self.cutoff_abs:g}"
        return text


@dataclass(frozen=True)
class Scheme:
    name: str
    doc: str
    rules: Mapping[str, Rule]
    # The rule of a tied embedding / LM head weight: torchtitan skips the embedding init and lets
    # the head's init write the shared tensor; the other sources initialise it as the embedding.
    tied_weight_kind: str = "embedding"

    def rule(self, kind: str, tied: bool = False) -> Rule:
        if kind == BIAS_KIND:
            return Rule("zeros")
        if tied and kind == "embedding":
            kind = self.tied_weight_kind
        if kind == "bias" and kind not in self.rules:  # projection biases start at zero in every cited scheme
            return Rule("zeros")
        return self.rules[kind]


def _normal(formula: str, sigma: Callable[[Dims], float]) -> Rule:
    return Rule("normal", formula, sigma)


def _trunc(formula: str, sigma: Callable[[Dims], float], sigmas: float = 3.0) -> Rule:
    return Rule("trunc_normal", formula, sigma, cutoff_sigmas=sigmas)


def _trunc_abs(formula: str, sigma: Callable[[Dims], float], cutoff: float = 2.0) -> Rule:
    return Rule("trunc_normal", formula, sigma, cutoff_abs=cutoff)


ONES = Rule("ones")

# The std formulas shared by several schemes.
STD_002 = ("0.02", lambda D: 0.02)
STD_DEPTH_LAYER = ("0.02/sqrt(2(l+1))", lambda D: 0.02 / math.sqrt(2 * (D.l + 1)))
STD_DEPTH_TOTAL = ("0.02/sqrt(2L)", lambda D: 0.02 / math.sqrt(2 * D.L))
STD_INV_SQRT_D = ("d^-0.5", lambda D: D.d ** -0.5)


def _torchtitan_llama(depth: tuple[str, Callable[[Dims], float]]) -> dict[str, Rule]:
    # trunc_normal_ without a/b: torch's default cutoffs ±2 in absolute units (≈ no truncation at 0.02).
    flat, scaled = _trunc_abs(*STD_002), _trunc_abs(*depth)
    return {
        "embedding": _normal("1.0", lambda D: 1.0),
        "qkv": flat, "attn_out": scaled,
        "ffn_gate": flat, "ffn_up": scaled, "ffn_down": scaled,
        "router": scaled,
        "expert_gate": flat, "expert_up": scaled, "expert_down": scaled,
        "lm_head": _trunc(*STD_INV_SQRT_D, sigmas=3.0),
        "norm": ONES,
    }


def _llama() -> Scheme:
    """torchtitan Llama3 / DeepSeek-V3 init with per-layer depth scaling (`depth_init=True`).

    Sources read: pytorch/torchtitan torchtitan/models/llama3/model/model.py @018740b7aae7846d24954539244c78215dbd181f
    (Attention/FeedForward/TransformerBlock/Transformer.init_weights), torchtitan/models/moe/moe.py
    @08dc75aee33a28ead10708854f9ae9a1ae8191f0 (GroupedExperts, TokenChoiceTopKRouter, shared FeedForward
    init_weights), torchtitan/models/deepseek_v3/model/model.py @ab033ddedcd503eee33b6de3dc0a5092ab101523,
    torchtitan/models/llama3/flavors.py @10503c1c3c113e0715f203b11a505e0b817289c3 (param_init form).
    Token embedding normal(std=1.0); wq/wk/wv and FFN/expert gate w1 trunc_normal(0.02); wo, FFN up w3,
    FFN down w2, expert w3/w2 and the router trunc_normal(0.02/sqrt(2(l+1))); every trunc_normal there
    uses torch's default cutoffs a=-2, b=2 (absolute), i.e. effectively untruncated; LM head
    trunc_normal(d^-0.5) cut at ±3σ; RMSNorm weights ones; no biases (a bias would be zeros).
    Tied embeddings (the 1B/3B flavors: `_EMBEDDING_SKIP_INIT` on the embedding) get the LM head rule.
    """
    return Scheme("llama", _llama.__doc__ or "", _torchtitan_llama(STD_DEPTH_LAYER), tied_weight_kind="lm_head")


def _depth_total() -> Scheme:
    """torchtitan Llama3 with `depth_init=False`: every layer's scaled weights at 0.02/sqrt(2L).

    Source: pytorch/torchtitan torchtitan/models/llama3/model/model.py @018740b7aae7846d24954539244c78215dbd181f
    (`TransformerBlock.__init__`: `weight_init_std = 0.02 / (2 * n_layers) ** 0.5` when not depth_init).
    Otherwise identical to `llama` (DeepSeek-V3 in torchtitan has no such option; the MoE rows are
    the `llama` MoE rows with the total-depth std).
    """
    return Scheme("depth-total", _depth_total.__doc__ or "", _torchtitan_llama(STD_DEPTH_TOTAL),
                  tied_weight_kind="lm_head")


def _gpt_oss() -> Scheme:
    """torchtitan GPT-OSS init: embeddings 0.02, every other matrix at the per-layer depth-scaled std.

    Source: pytorch/torchtitan torchtitan/models/gpt_oss/flavors.py @0276e6ed0bed9be143631e007342964c03a09b96
    (`_EMBEDDING_INIT` normal std 0.02; `_depth_init(layer_id)` trunc_normal(0.02/sqrt(2(l+1))) for the
    fused wqkv, wo and the router gate; experts w13/w2 trunc_normal at the same std, biases zeros for
    attention/router, trunc_normal for expert biases; LM head trunc_normal(d^-0.5) cut ±3σ; norms ones).
    The older torchtitan/models/gpt_oss/model/model.py @ff0829c10fbfbf86134c4908e4b06f1f97ee4e23 used
    normal(std=1.0) for the embedding instead. Cutoffs are torch's default ±2 (absolute).
    moetrain starts every bias (expert biases included) and the attention sinks at zero in every scheme
    (`BIAS_KIND`); dense FFN layers (GPT-OSS has none) get the same depth-scaled std as the experts.
    """
    scaled = _trunc_abs(*STD_DEPTH_LAYER)
    rules = {kind: scaled for kind in KINDS}
    rules.update(embedding=_normal(*STD_002), lm_head=_trunc(*STD_INV_SQRT_D, sigmas=3.0), norm=ONES)
    return Scheme("gpt-oss", _gpt_oss.__doc__ or "", rules, tied_weight_kind="lm_head")


def _olmo_normal() -> Scheme:
    """OLMo-core `InitMethod.normal`: every weight trunc_normal(0.02) cut at ±3σ, embeddings and LM head too.

    Source: allenai/OLMo-core src/olmo_core/nn/transformer/init.py @ae901c7d12d7c17cb9e247dbe6b50cde41be55d3
    (`_init_linear` trunc ±3·std with biases zeros; `init_embeddings` trunc_normal(0.02, ±0.06);
    `init_final_w_out` 0.02; MoE router 0.02; expert w1/w2/v1 0.02). Norm weights ones.
    (OLMo 1's `normal` in allenai/OLMo olmo/initialization.py @ce5f30d56e90f85d87e2fc8b9158dffe442c0fbd
    differs: cutoff optional, and modules flagged `_is_residual` (ff_out) divided by sqrt(2L).)
    """
    rule = _trunc(*STD_002)
    rules = {kind: rule for kind in KINDS}
    rules["norm"] = ONES
    return Scheme("olmo-normal", _olmo_normal.__doc__ or "", rules)


def _olmo_mitchell() -> Scheme:
    """OLMo 1 `mitchell`: std 1/sqrt(fan-in), outputs also divided by sqrt(2(l+1)); trunc ±3σ everywhere.

    Source: allenai/OLMo olmo/initialization.py @ce5f30d56e90f85d87e2fc8b9158dffe442c0fbd
    (`std = std_factor / sqrt(d)`, `/ sqrt(2 (layer_id+1))` when a layer id is passed, trunc ±3σ) and
    olmo/model.py (block `reset_parameters`: attn_out with d=d_model and ff_out with d=ff_out.in_features,
    both with layer_id; att_proj/ff_proj with d=d_model and no layer id; wte and the LM head ff_out with
    d=d_model). So q/k/v, FFN gate/up 1/sqrt(d); attention out 1/sqrt(2·d·(l+1)); FFN down
    1/sqrt(2·n_ff·(l+1)); embedding and LM head 1/sqrt(d) (std_factor 1 without scale_logits); biases zeros.
    OLMo 1 has no MoE: the router and expert gate/up follow the input rule, expert down the FFN-down rule
    with the expert width (moetrain's extension).
    """
    def out_rule(width: Callable[[Dims], int], text: str) -> Rule:
        return _trunc(text, lambda D: 1.0 / math.sqrt(2 * width(D) * (D.l + 1)))

    inputs = _trunc("1/sqrt(d)", lambda D: D.d ** -0.5)
    rules = {kind: inputs for kind in KINDS}
    rules.update(
        attn_out=out_rule(lambda D: D.d, "1/sqrt(2·d·(l+1))"),
        ffn_down=out_rule(lambda D: D.n_ff, "1/sqrt(2·n_ff·(l+1))"),
        expert_down=out_rule(lambda D: D.n_ff, "1/sqrt(2·n_ff·(l+1))"),
        norm=ONES,
    )
    return Scheme("olmo-mitchell", _olmo_mitchell.__doc__ or "", rules)


def _olmo_megatron() -> Scheme:
    """OLMo `full_megatron`: inputs 0.02, block outputs 0.02/sqrt(2L), embedding 0.02, LM head d^-0.5, ±3σ.

    Source: allenai/OLMo main branch, olmo/model.py @59a53e3f68e546330ca5a99ec626e58f9ab96494:
    `OLMo.reset_parameters` (full_megatron: wte_std = init_std, multiplied by sqrt(d_model) only when
    `scale_emb_init` is set, default False, and replaced by `emb_init_std` when given; ff_out
    d_model^-0.5; cutoff init_cutoff_factor or 3), `OLMoBlock.reset_parameters` (attn_out and ff_out
    init_std/sqrt(2·n_layers)), `OLMoSequentialBlock.reset_parameters` (att_proj, ff_proj init_std);
    `init_normal` in olmo/initialization.py truncates at ±cutoff_factor·std. init_std defaults to 0.02.
    `model.init_scale_embedding = True` is `scale_emb_init` (embedding 0.02·sqrt(d)). Router and expert
    gate/up are "in" modules, expert down an "out" module (moetrain's extension).
    """
    inputs, outputs = _trunc(*STD_002), _trunc(*STD_DEPTH_TOTAL)
    rules = {kind: inputs for kind in KINDS}
    rules.update(attn_out=outputs, ffn_down=outputs, expert_down=outputs, embedding=_trunc(*STD_002),
                 lm_head=_trunc(*STD_INV_SQRT_D), norm=ONES)
    return Scheme("olmo-megatron", _olmo_megatron.__doc__ or "", rules)


# OLMo's `scale_emb_init` (model.init_scale_embedding), the one option a catalog scheme takes.
SCALED_EMBEDDING = _trunc("0.02·sqrt(d)", lambda D: 0.02 * math.sqrt(D.d))


def _gpt2_like(name: str, doc: str) -> Scheme:
    inputs, outputs = _normal(*STD_002), _normal(*STD_DEPTH_TOTAL)
    rules = {kind: inputs for kind in KINDS}
    rules.update(attn_out=outputs, ffn_down=outputs, expert_down=outputs, norm=ONES)
    return Scheme(name, doc, rules)


def _gpt2() -> Scheme:
    """GPT-2 as Hugging Face and nanoGPT implement it: normal(0.02), residual output projections 0.02/sqrt(2L).

    Sources: huggingface/transformers src/transformers/models/gpt2/modeling_gpt2.py
    @c44b2d9976e8eafbdcb89cb2710141b2bc9b138f (`GPT2PreTrainedModel._init_weights`: Linear/Conv1D and
    Embedding normal(initializer_range=0.02), biases zeros, LayerNorm weight 1 / bias 0, every
    `c_proj.weight` — attention and MLP output — normal(0.02/sqrt(2·n_layer))); karpathy/nanoGPT model.py
    @04a1d697ddc57aadb2edbe95816bf86c6b8918b0 (same rule; lm_head tied to wte). Plain normals, no
    truncation. GPT-2 ties the LM head; untied, moetrain's head gets the Linear rule 0.02 like HF.
    Router and expert gate/up are input projections (0.02), expert down an output projection.
    """
    return _gpt2_like("gpt2", _gpt2.__doc__ or "")


def _megatron() -> Scheme:
    """Megatron-LM: `init_method_normal(0.02)` everywhere, `scaled_init_method_normal` 0.02/sqrt(2L) for outputs.

    Sources: NVIDIA/Megatron-LM megatron/core/transformer/moe/router.py @7d231ef578680f55d7e8b4c158bd9c9fffd23bf7
    (router weight [E, d] initialised by `config.init_method`); `init_method_normal(sigma)` = normal(sigma) and
    `scaled_init_method_normal(sigma, num_layers)` = normal(sigma/sqrt(2·num_layers)) with init_method_std 0.02
    and output_layer_init_method defaulting to the scaled one in TransformerConfig (read as excerpts of
    megatron/core/utils.py and transformer_config.py copies; commit not pinned). The scaled init covers the
    attention projection and fc2 of each block (expert fc2 included); embeddings and the untied output layer
    use init_method. Plain normals; biases zeros. On moetrain's bias-free,
    position-embedding-free model this table coincides with `gpt2` (GPT-2 in HF cites Megatron for it).
    """
    return _gpt2_like("megatron", _megatron.__doc__ or "")


def _neox() -> Scheme:
    """GPT-NeoX configs: `small_init` sqrt(2/(5d)) for inputs and embeddings, `wang_init` 2/(L·sqrt(d)) for outputs.

    Source: EleutherAI/gpt-neox megatron/model/init_functions.py @330a80215d765530d828c70f2abe1d2a450b69bd
    (`small_init_init_method`: normal(sqrt(2/(5·hidden))) — Nguyen & Salazar 2019, "Transformers without
    Tears"; `wang_init_method`: normal(2/n_layers/sqrt(hidden)); `get_init_methods` returns
    (init_method, output_layer_init_method)). init_method covers q/k/v, the MLP input, the word
    embedding and the final linear (passed by the model); output_layer_init_method covers the attention
    dense (out) and the MLP output. Plain normals; biases zeros. Router and expert gate/up follow
    small_init, expert down wang_init (moetrain's extension).
    """
    small = _normal("sqrt(2/(5d))", lambda D: math.sqrt(2 / (5 * D.d)))
    wang = _normal("2/(L·sqrt(d))", lambda D: 2 / D.L / math.sqrt(D.d))
    rules = {kind: small for kind in KINDS}
    rules.update(attn_out=wang, ffn_down=wang, expert_down=wang, norm=ONES)
    return Scheme("neox", _neox.__doc__ or "", rules)


SCHEMES: dict[str, Scheme] = {s.name: s for s in (
    _llama(), _gpt_oss(), _depth_total(), _olmo_normal(), _olmo_mitchell(), _olmo_megatron(),
    _gpt2(), _megatron(), _neox())}


def get_scheme(name: str, scale_embedding: bool = False) -> Scheme:
    """The catalog scheme `name`; `scale_embedding` (olmo-megatron only) scales its embedding std by sqrt(d)."""
    if name not in SCHEMES:
        raise ModelError(f"init scheme {name!r} is unknown; valid schemes: {', '.join(SCHEMES)}")
    scheme = SCHEMES[name]
    if not scale_embedding:
        return scheme
    if name != "olmo-megatron":
        raise ModelError(f"model.init_scale_embedding = True is invalid with init scheme {name!r}: only "
                          "'olmo-megatron' has it")
    return dataclasses.replace(scheme, rules={**scheme.rules, "embedding": SCALED_EMBEDDING})


# ---------------------------------------------------------------------------------------------
# Parameter name -> kinds


@dataclass(frozen=True)
class Segment:
    """A part of a parameter with one kind: columns [col_start, col_end) of the last dim (None: all)."""

    kind: str
    label: str
    dims: Dims
    col_start: int | None = None
    col_end: int | None = None


_WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def canonical_name(name: str) -> str:
    """Parameter name without wrapper components (activation checkpointing, compile)."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def is_adapter_name(name: str) -> bool:
    """Whether a (dotted) parameter name is a LoRA adapter's (`lora_A`, `lora_B1`, ...; model/lora.py)."""
    return name.rpartition(".")[2].startswith("lora_")


def classify(name: str, cfg: ModelConfig) -> list[Segment]:
    """The kinds making up parameter `name` of a `Transformer(cfg)`; ValueError for unknown names."""
    parts = canonical_name(name).split(".")
    top = Dims(cfg.dim, cfg.n_layers)
    if parts == ["tok_embeddings", "weight"]:
        return [Segment("embedding", "", top)]
    if parts == ["output", "weight"]:
        return [Segment("lm_head", "", top)]
    if parts == ["norm", "weight"]:
        return [Segment("norm", "", top)]
    if len(parts) >= 3 and parts[0] == "mtp" and parts[1].isdigit():  # multi-token prediction (model.mtp)
        layer = cfg.n_layers + int(parts[1])  # its block is numbered after the main blocks
        if parts[2] == "block":
            return classify(".".join(["layers", str(layer), *parts[3:]]), cfg)
        if parts[2:] in (["enorm", "weight"], ["hnorm", "weight"], ["norm", "weight"]):
            return [Segment("norm", "", top)]
        if parts[2:] == ["eh_proj", "weight"]:  # an input projection of the block, drawn like q/k/v
            return [Segment("qkv", "", Dims(cfg.dim, cfg.n_layers, layer, cfg.ffn_hidden))]
    if len(parts) >= 3 and parts[0] == "layers" and parts[1].isdigit():
        layer, rest = int(parts[1]), parts[2:]
        dims = Dims(cfg.dim, cfg.n_layers, layer, cfg.ffn_hidden)
        moe = cfg.moe
        projection_bias = len(rest) == 3 and rest[0] == "attention" and rest[1] in ("wq", "wk", "wv", "wo") \
            and rest[2] == "bias"
        if projection_bias or rest in (["attention", "sinks"], ["moe", "router", "bias"], ["moe", "experts", "b1"],
                                       ["moe", "experts", "b2"]):
            return [Segment(BIAS_KIND, "", dims)]
        if rest == ["moe", "shared_expert_gate", "weight"]:  # a one-output router
            return [Segment("router", "", dims)]
        if rest in (["attention_norm", "weight"], ["ffn_norm", "weight"], ["attention", "q_norm", "weight"],
                    ["attention", "k_norm", "weight"], ["attention", "q_a_norm", "weight"],
                    ["attention", "kv_a_norm", "weight"]):
            return [Segment("norm", "", dims)]
        if rest[0] == "attention" and rest[-1] == "weight" and len(rest) == 3:
            # wq_a, wq_b, wkv_a, wkv_b: multi-head latent attention's query and key/value paths.
            if rest[1] in ("wq", "wk", "wv", "wq_a", "wq_b", "wkv_a", "wkv_b"):
                return [Segment("qkv", "", dims)]
            if rest[1] == "wo":
                return [Segment("attn_out", "", dims)]
        ffn = {"w1": "ffn_gate", "w3": "ffn_up", "w2": "ffn_down"}
        if rest[0] == "feed_forward" and len(rest) == 3 and rest[1] in ffn:
            return [Segment(ffn[rest[1]], "", dims)]
        if rest[0] == "moe":
            if rest[1:] == ["router", "weight"]:
                return [Segment("router", "", dims)]
            if rest[1] == "shared_expert" and len(rest) == 4 and rest[2] in ffn:
                shared = Dims(cfg.dim, cfg.n_layers, layer, moe.shared_width())
                return [Segment(ffn[rest[2]], "", shared)]
            expert = Dims(cfg.dim, cfg.n_layers, layer, moe.expert_hidden)
            if rest[1:] == ["experts", "w2"]:
                return [Segment("expert_down", "", expert)]
            if rest[1:] == ["experts", "w1"]:
                n = moe.expert_hidden
                if moe.activation != "gelu":  # gated: [gate | up]
                    return [Segment("expert_gate", "gate", expert, 0, n), Segment("expert_up", "up", expert, n, 2 * n)]
                # GELU experts: the single input projection goes through the activation like the gate.
                return [Segment("expert_gate", "", expert)]
    raise ValueError(f"no init rule for parameter {name!r}")


# ---------------------------------------------------------------------------------------------
# Deterministic, shard-local drawing


def _block_seed(seed: int, name: str, label: str, block: int) -> int:
    digest = hashlib.sha256(f"{seed}|{name}|{label}|{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _draw_rows(rule: Rule, dims: Dims, shape: tuple[int, ...], row_start: int, row_end: int,
               seed: int, name: str, label: str) -> Tensor:
    """Rows [row_start, row_end) along dim 0 of a virtual tensor `shape` drawn with `rule` (float32, CPU)."""
    row_numel = math.prod(shape[1:])
    rows_per_block = max(1, BLOCK_NUMEL // max(row_numel, 1))
    first, last = row_start // rows_per_block, (row_end - 1) // rows_per_block
    sigma, cutoff = rule.sigma(dims), rule.cutoff(dims)
    pieces = []
    for block in range(first, last + 1):
        lo, hi = block * rows_per_block, min((block + 1) * rows_per_block, shape[0])
        generator = torch.Generator(device="cpu").manual_seed(_block_seed(seed, name, label, block))
        values = torch.empty((hi - lo, *shape[1:]), dtype=torch.float32)
        if rule.dist == "normal":
            values.normal_(0.0, sigma, generator=generator)
        else:
            nn.init.trunc_normal_(values, 0.0, sigma, -cutoff, cutoff, generator=generator)
        pieces.append(values)
    rows = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    offset = first * rows_per_block
    return rows[row_start - offset:row_end - offset]


def _local_view(param: Tensor) -> tuple[Tensor, tuple[int, ...], tuple[int, ...]]:
    """(local tensor, global shape, global offset of the local tensor) for plain or DTensor params."""
    if isinstance(param, DTensor):
        local = param.to_local()
        _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        return local, tuple(param.shape), tuple(offset)
    return param, tuple(param.shape), (0,) * param.dim()


@torch.no_grad()
def fill_parameter(param: Tensor, name: str, segments: list[Segment], scheme: Scheme, seed: int,
                   tied: bool = False) -> None:
    """Initialise the local part of `param` in place; the result does not depend on the sharding."""
    local, global_shape, offset = _local_view(param)
    if local.numel() == 0:
        return
    last = len(global_shape) - 1
    for seg in segments:
        rule = scheme.rule(seg.kind, tied)
        c0 = 0 if seg.col_start is None else seg.col_start
        c1 = global_shape[last] if seg.col_end is None else seg.col_end
        lo, hi = max(c0, offset[last]), min(c1, offset[last] + local.shape[last])
        if lo >= hi:
            continue
        target = local.narrow(last, lo - offset[last], hi - lo)
        if rule.dist in ("ones", "zeros"):
            target.fill_(rule.target_mean())
            continue
        virtual = (*global_shape[:last], c1 - c0) if last > 0 else (c1 - c0,)
        rows = _draw_rows(rule, seg.dims, virtual, offset[0], offset[0] + local.shape[0], seed, name, seg.label)
        for dim in range(1, last):
            rows = rows.narrow(dim, offset[dim], local.shape[dim])
        if last > 0:
            rows = rows.narrow(last, lo - c0, hi - lo)
        target.copy_(rows.to(device=target.device, dtype=target.dtype))


@contextlib.contextmanager
def single_cpu_thread():
    """Run the enclosed init or report work on one intra-op thread; the thread count is restored after."""
    # The blocks are small: intra-op threads only add synchronisation, which on a busy machine
    # (more runnable threads than cores) made init + report 4-6x slower than one thread (measured
    # side by side on the 2-core dev machine under load: 0.2-0.26 s vs 0.98-1.38 s for tiny_moe).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def init_model(model: nn.Module, scheme_name: str, seed: int = 0) -> None:
    """Initialise every parameter of a `Transformer` (plain or FSDP-sharded) and reset its buffers."""
    cfg: ModelConfig = model.cfg
    scheme = get_scheme(scheme_name, cfg.init_scale_embedding)
    with single_cpu_thread():
        for name, param in model.named_parameters():
            canonical = canonical_name(name)
            if is_adapter_name(canonical):  # LoRA adapters start as PEFT starts them: model/lora.py
                continue
            fill_parameter(param, canonical, classify(canonical, cfg), scheme, seed, tied=cfg.tie_embeddings)
    reset_buffers(model)


def reset_buffers(model: nn.Module) -> None:
    """Give the buffers no checkpoint or weight file carries (balancing state) their start values."""
    for module in model.modules():
        reset = getattr(module, "reset_buffers", None)
        if callable(reset):
            reset()
