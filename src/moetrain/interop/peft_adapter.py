"""A model's LoRA adapters as a PEFT adapter directory, and back: adapter_config.json + adapter_model.safetensors.

The directory is what `peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), DIR)`
loads. Layers applied to activations (attention, MLA's low-rank projections, dense and shared-expert
feed-forwards) are PEFT `target_modules`, named by the module path the family's tensor names give;
the router and the routed experts are `target_parameters`: transformers 5 fuses a layer's experts into
3-D parameters, which PEFT reaches only by naming the parameter (`mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`) and adapts with one (A, B) block per expert. Tensors are stored as PEFT
stores them:

- a module or 2-D parameter: `lora_A.weight` [r, in], `lora_B.weight` [out, r];
- a 3-D expert parameter: `lora_A.weight` [E·r, in] (expert e's A in rows e·r ... e·r + r - 1) and
  `lora_B.weight` [out, r·E] (expert e's B in columns k·E + e); moetrain's per-expert A [E, r, in] and
  B [E, out, r] are the same blocks, whichever way transformers lays the parameter out ([E, out, in] or
  GPT-OSS's [E, in, out]), with GPT-OSS's interleaved gate/up order applied to B's rows. Two targeted
  parameters of one module nest (PEFT wraps them in the module's parameter order), so the first one's
  keys read `experts.base_layer.lora_A.weight`.

Only attention projections are `target_modules`: PEFT rewrites module targets named like the feed-forward
projections of transformers 4 (`gate_proj`, `up_proj`, `down_proj`, `gate`) into fused expert parameters
for the families transformers 5 converts (DeepSeek-V3, Qwen2-MoE, Mixtral), so the dense and shared-expert
feed-forwards are named as parameters too (`mlp.shared_experts.gate_proj.weight`, the same update folded).
One shared expert adapter is written as E equal per-expert blocks (the same update). Grouped-query q/k
rows in moetrain's interleaved RoPE layout are put back in the files' order, as the weights are.
Refused, in one line: a family whose fused expert names moetrain does not know, and on import every
PEFT option moetrain does not compute (DoRA, rsLoRA, per-module ranks, bias adapters, ...), another rank
or alpha than the job's, or tensors that are not exactly this model's adapters (another base or
family). Reading parses JSON and safetensors only; nothing is unpickled. No training here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from moetrain.config.job import JobConfig
from moetrain.errors import ConfigError
from moetrain.interop import families
from moetrain.interop.config_map import export_family
from moetrain.interop.hf_io import ROPE_ROWS, check_output_dir
from moetrain.interop.layouts import fused_expert_names
from moetrain.interop.sharded_tensors import copy_full_into, full, rope_reorder
from moetrain.model.init import canonical_name
from moetrain.model.layers import rope_permutation
from moetrain.model.lora import LoRAExpertWeights, LoRALinear, apply_lora
from moetrain.model.transformer import Transformer
from moetrain.parallel.collectives import barrier, rank_and_world

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."

IN_MEMORY_RENAMES = {"mixtral": (".block_sparse_moe.", ".mlp.")}
"""Families whose files keep transformers 4's per-expert names, which transformers 5 loads into fused 3-D
parameters under module names of its own (Mixtral: `mlp.gate`, `mlp.experts.gate_up_proj` / `down_proj`).
PEFT targets the loaded model's names, so the adapters are written under those."""

# adapter_config.json options and the values moetrain computes; any other value is refused on import.
IMPLEMENTED_OPTIONS = {"peft_type": ("LORA",), "use_dora": (False, None), "use_rslora": (False, None),
                       "lora_bias": (False, None), "bias": ("none", None), "fan_in_fan_out": (False, None),
                       "rank_pattern": ({}, None), "alpha_pattern": ({}, None), "modules_to_save": (None, []),
                       "layers_to_transform": (None,), "layer_replication": (None,), "use_qalora": (False, None),
                       "trainable_token_indices": (None,), "alora_invocation_tokens": (None,),
                       "exclude_modules": (None, []), "use_bdlora": (None, False), "kasa_config": (None,),
                       "arrow_config": (None,), "monteclora_config": (None,), "megatron_config": (None,)}


@dataclass
class Entry:
    """One adapter tensor: the moetrain parameter, its PEFT key, and the maps between their layouts."""

    param: nn.Parameter
    key: str
    to_peft: Callable[[Tensor], Tensor]
    from_peft: Callable[[Tensor], Tensor]
    peft_shape: tuple[int, ...]


def _same(t: Tensor) -> Tensor:
    return t


def _expert_A(n_experts: int) -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]:
    """[E or 1, r, in] <-> PEFT's [E·r, in]."""
    def to_peft(a: Tensor) -> Tensor:
        return a.expand(n_experts, -1, -1).reshape(-1, a.shape[-1])

    def from_peft(a: Tensor) -> Tensor:
        return a.reshape(n_experts, -1, a.shape[-1])
    return to_peft, from_peft


def _expert_B(n_experts: int, rows: Tensor | None) -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]:
    """[E or 1, out, r] <-> PEFT's [out, r·E] (column k·E + e), output rows reordered by `rows` (GPT-OSS)."""
    inverse = None if rows is None else torch.argsort(rows)

    def to_peft(b: Tensor) -> Tensor:
        b = b.expand(n_experts, -1, -1)
        if rows is not None:
            b = b[:, rows]
        return b.permute(1, 2, 0).reshape(b.shape[1], -1)

    def from_peft(b: Tensor) -> Tensor:
        b = b.reshape(b.shape[0], -1, n_experts).permute(2, 0, 1)
        return b if inverse is None else b[:, inverse]
    return to_peft, from_peft


def _rope_rows(head_dim: int) -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]:
    to_half, to_interleaved = torch.argsort(rope_permutation(head_dim)), rope_permutation(head_dim)
    return (lambda b: rope_reorder(b, head_dim, to_half)), (lambda b: rope_reorder(b, head_dim, to_interleaved))


def adapter_entries(model: nn.Module, cfg: JobConfig) -> tuple[list[Entry], list[str], list[str]]:
    """(entries, target_modules, target_parameters) of `model`'s adapters in the family's PEFT names."""
    family = families.family(export_family(cfg.model))
    names = family.tensor_names(cfg.model)
    if family.model_type in IN_MEMORY_RENAMES:
        names = {ours: theirs.replace(*IN_MEMORY_RENAMES[family.model_type]) for ours, theirs in names.items()}
    model_cfg, n_experts = cfg.model, cfg.model.moe.n_experts
    entries: list[Entry] = []
    modules: list[str] = []
    parameters: list[str] = []
    for path, module in model.named_modules():
        path = canonical_name(path)
        if isinstance(module, LoRALinear):
            hf_weight = names[f"{path}.weight"]
            hf_module = hf_weight.removesuffix(".weight")
            as_parameter = ".attention." not in f".{path}."
            (parameters if as_parameter else modules).append(hf_weight if as_parameter else hf_module)
            b_maps = (_same, _same)
            if (model_cfg.rope_layout == "interleaved" and model_cfg.kv_lora_rank is None
                    and f"{path}.weight".endswith(ROPE_ROWS)):
                b_maps = _rope_rows(model_cfg.attention_head_dim())
            entries.append(Entry(module.lora_A, f"{PREFIX}{hf_module}.lora_A.weight", _same, _same,
                                 tuple(module.lora_A.shape)))
            entries.append(Entry(module.lora_B, f"{PREFIX}{hf_module}.lora_B.weight", *b_maps,
                                 tuple(module.lora_B.shape)))
        elif isinstance(module, LoRAExpertWeights):
            layer = int(path.split(".")[1])
            entries += _expert_entries(module, family, layer, n_experts, model_cfg.moe.expert_hidden, parameters)
    return entries, modules, parameters


def _expert_entries(experts: LoRAExpertWeights, family: families.Family, layer: int, n_experts: int, n: int,
                    parameters: list[str]) -> list[Entry]:
    if family.interleaved_expert_names is not None:
        gate_up, _, down, _ = family.interleaved_expert_names(layer)
        gate_up_rows = torch.stack((torch.arange(n), torch.arange(n) + n), dim=-1).flatten()  # gate | up -> 0::2, 1::2
    elif family.fused_expert_names is not None or family.model_type in IN_MEMORY_RENAMES:
        gate_up, down = (family.fused_expert_names or fused_expert_names)(layer)
        gate_up_rows = None
    else:
        raise ConfigError(f"lora.targets = 'experts' cannot be exported for {family.label}: PEFT reaches routed "
                          "experts only through transformers' fused expert parameters, whose names moetrain does "
                          "not know for this family")
    module = gate_up.rpartition(".")[0]
    parameters += [gate_up, down]
    entries = []
    # PEFT wraps gate_up_proj first (the module's parameter order), so its keys carry one "base_layer".
    for (a, b), key, rows in (((experts.lora_A1, experts.lora_B1), f"{module}.base_layer", gate_up_rows),
                              ((experts.lora_A2, experts.lora_B2), module, None)):
        a_peft = (n_experts * a.shape[1], a.shape[2])
        b_peft = (b.shape[1], b.shape[2] * n_experts)
        entries.append(Entry(a, f"{PREFIX}{key}.lora_A.weight", *_expert_A(n_experts), a_peft))
        entries.append(Entry(b, f"{PREFIX}{key}.lora_B.weight", *_expert_B(n_experts, rows), b_peft))
    return entries


def adapter_config(cfg: JobConfig, modules: list[str], parameters: list[str], base: str | None) -> dict:
    lora = cfg.lora
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "r": lora.rank,
            "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": sorted(modules),
            "target_parameters": sorted(parameters) or None, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "use_dora": False, "lora_bias": False, "init_lora_weights": True,
            "inference_mode": True, "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {}}


def save_peft_adapter(model: nn.Module, cfg: JobConfig, out_dir: str | Path) -> Path:
    """Write `model`'s adapters (plain or sharded; collective then) as a PEFT adapter directory `out_dir`."""
    out = check_output_dir(out_dir)
    barrier()  # every rank has checked before rank 0 writes
    entries, modules, parameters = adapter_entries(model, cfg)
    if not entries:
        raise ConfigError("lora.rank = 0: the run has no adapters to export; use --lora merged or leave --lora out")
    state = {e.key: e.to_peft(full(e.param.detach()).float().cpu()).contiguous() for e in entries}
    base = cfg.model.init_from[3:] if cfg.model.init_from else None
    if rank_and_world()[0] == 0:
        out.mkdir(parents=True, exist_ok=True)
        save_file(state, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
        text = json.dumps(adapter_config(cfg, modules, parameters, base), indent=2) + "\n"
        (out / CONFIG_FILE).write_text(text)
    barrier()
    return out


def _read_config(directory: Path) -> dict:
    path = directory / CONFIG_FILE
    if not path.is_file() or not (directory / WEIGHTS_FILE).is_file():
        raise ConfigError(f"lora.init_from = {str(directory)!r} is not a PEFT adapter directory: it needs "
                          f"{CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"lora.init_from: {path} is not readable JSON ({err})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"lora.init_from: {path} does not hold a JSON object")
    return config


def check_adapter_config(config: dict, cfg: JobConfig, where: str) -> None:
    """One ConfigError line for an adapter_config.json this job cannot continue from."""
    for option, allowed in IMPLEMENTED_OPTIONS.items():
        value = config.get(option, allowed[0])  # absent: PEFT's default, which moetrain computes
        if value not in allowed:
            raise ConfigError(f"lora.init_from: {where} sets {option} = {value!r}, which moetrain does not "
                              f"implement (it computes {allowed[0]!r})")
    for option, ours in (("r", cfg.lora.rank), ("lora_alpha", cfg.lora.alpha), ("lora_dropout", cfg.lora.dropout)):
        if config.get(option) != ours:
            raise ConfigError(f"lora.init_from: {where} has {option} = {config.get(option)!r}, but the job's "
                              f"lora.{ {'r': 'rank', 'lora_alpha': 'alpha', 'lora_dropout': 'dropout'}[option]} = "
                              f"{ours!r}; set it to match")


@torch.no_grad()
def _whole_model(cfg: JobConfig) -> nn.Module:
    """The job's whole model with its adapters, on the meta device: the targets and tensors its directory holds."""
    with torch.device("meta"):
        whole = Transformer(cfg.model)
    apply_lora(whole, cfg.lora)
    return whole


@torch.no_grad()  # writes into the adapters' (sharded) parameters in place
def load_peft_adapter(model: nn.Module, cfg: JobConfig, directory: str | Path) -> None:
    """Fill `model`'s adapters from a PEFT adapter directory (collective when sharded); one ConfigError line
    when the directory is not exactly the whole model's adapters. A pipeline rank's part (its own layers, by
    the whole model's names) reads only its layers' tensors."""
    directory = Path(directory)
    config = _read_config(directory)
    where = str(directory / CONFIG_FILE)
    check_adapter_config(config, cfg, where)
    entries = adapter_entries(model, cfg)[0]  # this model's (a pipeline stage: its own layers')
    whole_entries, modules, parameters = adapter_entries(_whole_model(cfg), cfg)  # what the directory must hold
    theirs_modules, theirs_params = sorted(config.get("target_modules") or []), sorted(config.get("target_parameters")
                                                                                      or [])
    if (theirs_modules, theirs_params) != (sorted(modules), sorted(parameters)):
        missing = sorted(set(modules + parameters) - set(theirs_modules + theirs_params))
        extra = sorted(set(theirs_modules + theirs_params) - set(modules + parameters))
        raise ConfigError(f"lora.init_from: {where} targets other layers than this job's lora.targets on this "
                          f"model (another base, family or targets?): missing {missing[:3]}, extra {extra[:3]}")
    with safe_open(str(directory / WEIGHTS_FILE), framework="pt") as f:
        keys = set(f.keys())
        wanted = {e.key for e in whole_entries}
        if keys != wanted:
            odd = sorted(keys ^ wanted)[:3]
            raise ConfigError(f"lora.init_from: {directory / WEIGHTS_FILE} does not hold exactly this model's "
                              f"adapter tensors (another base or family?): differs at {odd}")
        for entry in entries:
            tensor = f.get_tensor(entry.key)
            if tuple(tensor.shape) != entry.peft_shape:
                raise ConfigError(f"lora.init_from: {entry.key} has shape {tuple(tensor.shape)}, this model's is "
                                  f"{entry.peft_shape} (another base or family?)")
            ours = entry.from_peft(tensor.float())
            if ours.shape[0] != entry.param.shape[0]:  # one shared expert adapter: every expert's copy must agree
                if not bool((ours == ours[:1]).all()):
                    raise ConfigError(f"lora.init_from: {entry.key} holds a different adapter per expert; "
                                      "lora.expert_mode = 'shared' needs one (use per_expert)")
                ours = ours[:1]
            copy_full_into(entry.param, ours.to(entry.param.dtype))
