"""Reading and writing a Hugging Face directory's safetensors files, plain or sharded (FSDP/HSDP, EP).

Reading and writing go through torch.distributed.checkpoint's Hugging Face storage reader and
writer, so a sharded model is imported and exported shard by shard: each rank reads or writes only
the slices (and the experts) it holds, and a sharded export is consolidated into whole-tensor files
one tensor at a time; no rank ever holds the whole model. Only q/k weights of a model kept in
moetrain's interleaved RoPE layout are gathered whole (one matrix at a time) to permute their rows
(`moetrain.model.layers.rope_permutation`) to the files' "rotate half" layout, and expert blocks
that expert parallelism had FSDP shard on dim 1 are gathered to whole experts of their rank.

Names come from the directory's family adapter (`interop.families`); this module knows no family
by name. It builds no model and no process group, and parses no command line.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch import Tensor, nn
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

from moetrain.config.job import JobConfig
from moetrain.config.model import ModelConfig
from moetrain.data.chat import ConversationError, end_of_turn_ids, load_chat_template
from moetrain.data.tokenizer import (
    BYTE_SPECIAL_TOKENS,
    HFTokenizer,
    Tokenizer,
    build_tokenizer,
    tokenizer_file,
    write_byte_level_tokenizer,
)
from moetrain.errors import ConfigError
from moetrain.interop import families
from moetrain.interop.adapter import Family
from moetrain.interop.config_json import hf_dir
from moetrain.interop.config_map import check_architecture, export_family, hf_config
from moetrain.interop.sharded_tensors import (
    back_into,
    by_rows,
    copy_full_into,
    full,
    local_rows,
    local_view,
    rope_reorder,
    rows_like,
)
from moetrain.logging import get_logger
from moetrain.model.init import canonical_name
from moetrain.model.layers import rope_permutation
from moetrain.model.transformer import Transformer
from moetrain.parallel.collectives import all_ranks_true, barrier, distributed, multi_rank, rank_and_world

log = get_logger("interop")
INDEX_FILE = "model.safetensors.index.json"
# Output files of an export are split at about this size, like save_pretrained's shards.
MAX_FILE_BYTES = 5 * 1024**3
# moetrain names of the tensors whose rows are permuted between the interleaved and half RoPE layouts.
ROPE_ROWS = ("attention.wq.weight", "attention.wk.weight", "attention.q_norm.weight", "attention.k_norm.weight",
             "attention.wq.bias", "attention.wk.bias")


def _model_tensors(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter and buffer of `model` by its canonical name (wrappers left out)."""
    tensors = {canonical_name(name): buffer for name, buffer in model.named_buffers()}
    tensors.update((canonical_name(name), param) for name, param in model.named_parameters())
    return tensors


def routed_layers(cfg: ModelConfig) -> list[tuple[int, str]]:
    """(Hugging Face layer index, moetrain MoE module name) of every layer with routed experts: the main MoE
    blocks, then the multi-token-prediction blocks, which the files number after them."""
    main = [(layer, f"layers.{layer}.moe") for layer in range(cfg.n_dense_layers, cfg.n_layers)]
    return main + [(cfg.n_layers + k, f"mtp.{k}.block.moe") for k in range(cfg.mtp_depth)]


def _shared_copies(family: Family, cfg: ModelConfig) -> dict[str, str]:
    return family.shared_copies(cfg) if family.shared_copies is not None else {}


def _needs_rope_reorder(cfg: ModelConfig, name: str) -> bool:
    # Multi-head latent attention keeps the files' row order: the family maps its layout to rope_interleave.
    return cfg.rope_layout == "interleaved" and cfg.kv_lora_rank is None and name.endswith(ROPE_ROWS)


def expected_shapes(family: Family, cfg: ModelConfig, tensors: dict[str, Tensor],
                    fused_layers: set[int] = frozenset()) -> dict[str, tuple[int, ...]]:
    """Every tensor a directory of this architecture holds, in file order, with its shape (per-expert
    layout except `fused_layers`): the model's own shape for all but the routed experts."""
    d, n, n_experts = cfg.dim, cfg.moe.expert_hidden, cfg.moe.n_experts
    shapes = {theirs: tuple(tensors[ours].shape) for ours, theirs in family.tensor_names(cfg).items()}
    shapes.update((theirs, tuple(tensors[ours].shape)) for theirs, ours in _shared_copies(family, cfg).items())
    for layer, _ in routed_layers(cfg):
        if family.interleaved_expert_names is not None:
            gate_up, gate_up_bias, down, down_bias = family.interleaved_expert_names(layer)
            shapes[gate_up], shapes[down] = (n_experts, d, 2 * n), (n_experts, n, d)
            if cfg.moe.expert_proj_bias:
                shapes[gate_up_bias], shapes[down_bias] = (n_experts, 2 * n), (n_experts, d)
            continue
        if layer in fused_layers:
            gate_up, down = family.fused_expert_names(layer)
            shapes[gate_up], shapes[down] = (n_experts, 2 * n, d), (n_experts, d, n)
            continue
        for e in range(n_experts):
            gate, up, down = family.expert_names(layer, e)
            shapes[gate], shapes[up], shapes[down] = (n, d), (n, d), (d, n)
    return shapes


# safetensors dtypes a weight may be stored in: read as they are (cast to the model's dtype like any
# checkpoint); float64 is read too but said in one warning line (half its precision is dropped).
FLOAT_DTYPES = frozenset({"F32", "F16", "BF16"})


def stored_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in the directory's safetensors files (headers only)."""
    return stored_headers(model_dir)[0]


def stored_headers(model_dir: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """(name -> shape, name -> safetensors dtype) of every tensor in the directory's files (headers only).

    Every weight file must be a regular file (a link to one is fine: the Hugging Face cache is made
    of them): opening a FIFO or a device named *.safetensors would block or never end.
    """
    files = sorted(model_dir.glob("*.safetensors"))
    for path in files:
        if not path.is_file():
            raise ConfigError(f"{path} is not a regular file (a FIFO, device or directory?); a weight file must be "
                              "a safetensors file")
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
    shapes, dtypes, where = {}, {}, {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                for key in handle.keys():
                    if key in where and not index.is_file():  # which copy would be read is then a guess
                        raise ConfigError(f"{model_dir}: tensor {key} is in both {where[key]} and {path.name}, and "
                                          f"there is no {INDEX_FILE} to say which is meant; keep one")
                    where[key] = path.name
                    shapes[key] = tuple(handle.get_slice(key).get_shape())
                    dtypes[key] = handle.get_slice(key).get_dtype()
        except ConfigError:
            raise
        except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
            raise ConfigError(f"{path} is not a readable safetensors file: {str(err).splitlines()[0]}") from None
    return shapes, dtypes


def _check_dtypes(model_dir: Path, dtypes: dict[str, str]) -> None:
    """Refuse weights that are not floating point (one line); say in one warning line that float64 is cast."""
    not_float = sorted(name for name, dtype in dtypes.items() if dtype not in FLOAT_DTYPES | {"F64"})
    if not_float:
        raise ConfigError(f"{model_dir}: tensor {not_float[0]} is stored as {dtypes[not_float[0]]}, not a floating-"
                          f"point type ({', '.join(sorted(FLOAT_DTYPES | {'F64'}))}): it cannot be a weight"
                          + (f" (and {len(not_float) - 1} more)" if len(not_float) > 1 else ""))
    wide = sorted(name for name, dtype in dtypes.items() if dtype == "F64")
    if wide:
        log.warning("%s: %d tensor(s) stored as float64 (e.g. %s) are cast to the model's dtype", model_dir,
                    len(wide), wide[0])


def _check_stored(family: Family, cfg: ModelConfig, tensors: dict[str, Tensor], model_dir: Path) -> set[int]:
    """Check the files hold exactly the architecture's tensors; return the MoE layers stored fused."""
    stored, dtypes = stored_headers(model_dir)
    if family.skipped_tensors is not None:  # tensors of parts the job does not compute
        skipped = sorted(name for name in stored if family.skipped_tensors(cfg, name))
        if skipped:
            log.warning("%s: %d tensor(s) the job does not compute are not read (e.g. %s; model.mtp_depth = %d)",
                        model_dir, len(skipped), skipped[0], cfg.mtp_depth)
        stored = {name: shape for name, shape in stored.items() if name not in skipped}
    fused = ({layer for layer, _ in routed_layers(cfg)
              if family.fused_expert_names(layer)[0] in stored} if family.fused_expert_names else set())
    want = expected_shapes(family, cfg, tensors, fused)
    missing = [name for name in want if name not in stored]
    if missing:
        mtp_layers = tuple(f"model.layers.{cfg.n_layers + k}." for k in range(cfg.mtp_depth))
        hint = (f"; model.mtp_depth = {cfg.mtp_depth} reads multi-token-prediction layers (transformers' "
                "save_pretrained drops them): set --model.mtp_depth 0 to import without them"
                if missing[0].startswith(mtp_layers) else "")
        raise ConfigError(f"{model_dir}: tensor {missing[0]} is missing from its safetensors files"
                          + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "") + hint)
    for name, shape in want.items():
        if stored[name] != shape:
            raise ConfigError(f"{model_dir}: tensor {name} has shape {list(stored[name])}, config.json implies "
                              f"{list(shape)}")
    _check_dtypes(model_dir, {name: dtypes[name] for name in want})
    unexpected = sorted(set(stored) - set(want))
    if unexpected:
        raise ConfigError(f"{model_dir}: tensor {unexpected[0]} is not part of the architecture in config.json "
                          f"(an unsupported option?)" + (f" (and {len(unexpected) - 1} more)"
                                                         if len(unexpected) > 1 else ""))
    return fused


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
    family = families.family(check_architecture(cfg, model_dir)[0])
    tensors = _model_tensors(model)
    whole = tensors
    if any(name not in tensors for name in family.tensor_names(cfg)):  # a pipeline stage: check the whole model
        with torch.device("meta"):
            whole = _model_tensors(Transformer(cfg))
    fused = _check_stored(family, cfg, whole, model_dir)
    state, finish = _import_targets(family, cfg, tensors, fused)
    with _quiet_single_process():
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(model_dir)), no_dist=not multi_rank())
    with torch.no_grad():
        for step in finish:
            step()
        _check_shared_copies(family, cfg, tensors, state, model_dir)


def _check_shared_copies(family: Family, cfg: ModelConfig, tensors: dict[str, Tensor], state: dict[str, Tensor],
                         model_dir: Path) -> None:
    """The files' copies of a shared tensor (DeepSeek-V3's MTP embedding and head) must equal it exactly
    (moetrain keeps one tensor): one ConfigError line, on every rank, naming the first that differs."""
    for theirs, ours in _shared_copies(family, cfg).items():
        same = torch.equal(local_view(state[theirs])[0], local_view(tensors[ours].detach())[0])
        if not all_ranks_true(same):
            raise ConfigError(f"{model_dir}: tensor {theirs} differs from the one it should copy (moetrain shares "
                              f"{ours} with it): a directory whose multi-token-prediction layers have their own "
                              "embedding or head is not supported")


def _named_targets(family: Family, cfg: ModelConfig, tensors: dict[str, Tensor], state: dict[str, Tensor],
                   finish: list[Callable[[], None]]) -> None:
    """The tensors with one HF name each (all but routed experts) into `state`, RoPE reorders into `finish`."""
    head_dim = cfg.attention_head_dim()
    order = rope_permutation(head_dim)  # half -> interleaved

    def reorder_into(param: Tensor, buffer: Tensor) -> Callable[[], None]:
        return lambda: copy_full_into(param, rope_reorder(full(buffer), head_dim, order))

    for ours, theirs in family.tensor_names(cfg).items():
        if ours not in tensors:  # a pipeline stage reads only its own layers
            continue
        param = tensors[ours].detach()
        if _needs_rope_reorder(cfg, ours):
            state[theirs] = torch.empty_like(param)
            finish.append(reorder_into(param, state[theirs]))
        else:
            state[theirs] = param  # read straight into the (local shard of the) parameter
    for theirs, ours in _shared_copies(family, cfg).items():  # read aside, compared by _check_shared_copies
        state[theirs] = torch.empty_like(tensors[ours].detach())


def _import_targets(family: Family, cfg: ModelConfig, tensors: dict[str, Tensor],
                    fused: set[int]) -> tuple[dict[str, Tensor], list[Callable[[], None]]]:
    """HF name -> tensor DCP fills in place, and the copies that then move buffered values into parameters."""
    n = cfg.moe.expert_hidden
    state: dict[str, Tensor] = {}
    finish: list[Callable[[], None]] = []

    def fused_into(local_w1: Tensor, local_w2: Tensor, gate_up: Tensor, down: Tensor) -> Callable[[], None]:
        def copy() -> None:
            local_w1.copy_(local_view(gate_up)[0].transpose(1, 2))
            local_w2.copy_(local_view(down)[0].transpose(1, 2))
        return copy

    def deinterleave_into(local: Tensor, gate_up: Tensor) -> Callable[[], None]:
        def copy() -> None:  # gate = [..., 0::2], up = [..., 1::2] -> moetrain's [gate | up] halves
            buffer = local_view(gate_up)[0]
            local[..., :n].copy_(buffer[..., 0::2])
            local[..., n:].copy_(buffer[..., 1::2])
        return copy

    def expert_into(local_w1: Tensor, local_w2: Tensor, row: int, gate: Tensor, up: Tensor,
                    down: Tensor) -> Callable[[], None]:
        def copy() -> None:
            local_w1[row, :, :n].copy_(gate.T)
            local_w1[row, :, n:].copy_(up.T)
            local_w2[row].copy_(down.T)
        return copy

    _named_targets(family, cfg, tensors, state, finish)
    for layer, moe in routed_layers(cfg):
        if f"{moe}.experts.w1" not in tensors:  # another pipeline stage's layer
            continue
        w1_param = tensors[f"{moe}.experts.w1"].detach()
        w2_param = tensors[f"{moe}.experts.w2"].detach()
        w1, w2 = by_rows(w1_param), by_rows(w2_param)  # the parameters themselves unless sharded on dim 1
        local_w1, first = local_rows(w1)
        local_w2, _ = local_rows(w2)
        pairs = [(w1_param, w1), (w2_param, w2)]
        if family.interleaved_expert_names is not None:
            gate_up_name, gate_up_bias_name, down_name, down_bias_name = family.interleaved_expert_names(layer)
            state[gate_up_name] = rows_like(w1, (cfg.moe.n_experts, cfg.dim, 2 * n))
            finish.append(deinterleave_into(local_w1, state[gate_up_name]))
            state[down_name] = w2  # the same layout as moetrain's w2: read in place
            if cfg.moe.expert_proj_bias:  # the biases travel with their experts (EP), whole rows as the weights
                b1_param = tensors[f"{moe}.experts.b1"].detach()
                b2_param = tensors[f"{moe}.experts.b2"].detach()
                b1, b2 = by_rows(b1_param), by_rows(b2_param)
                state[gate_up_bias_name] = rows_like(b1, tuple(b1.shape))
                finish.append(deinterleave_into(local_rows(b1)[0], state[gate_up_bias_name]))
                state[down_bias_name] = b2
                pairs += [(b1_param, b1), (b2_param, b2)]
        elif layer in fused:
            gate_up_name, down_name = family.fused_expert_names(layer)
            state[gate_up_name] = rows_like(w1, (cfg.moe.n_experts, 2 * n, cfg.dim))
            state[down_name] = rows_like(w2, (cfg.moe.n_experts, cfg.dim, n))
            finish.append(fused_into(local_w1, local_w2, state[gate_up_name], state[down_name]))
        else:
            for row in range(local_w1.shape[0]):  # only the experts this rank holds
                names = family.expert_names(layer, first + row)
                gate, up = local_w1.new_empty(n, cfg.dim), local_w1.new_empty(n, cfg.dim)
                down = local_w2.new_empty(cfg.dim, n)
                state.update(zip(names, (gate, up, down), strict=True))
                finish.append(expert_into(local_w1, local_w2, row, gate, up, down))
        for param, rows in pairs:
            if rows is not param:
                finish.append(lambda param=param, rows=rows: back_into(param, rows))
    return state, finish


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


def _interleaved(t: Tensor, n: int) -> Tensor:
    """[..., gate | up] (halves of width n) -> gate and up interleaved ([..., 0::2] gate), sharded like `t`."""
    out = rows_like(t, tuple(t.shape))
    local = local_view(t)[0]
    local_view(out)[0].copy_(torch.stack((local[..., :n], local[..., n:]), dim=-1).flatten(-2))
    return out


def _export_tensors(family: Family, cfg: ModelConfig, tensors: dict[str, Tensor],
                    dtype: torch.dtype) -> dict[str, Tensor]:
    """HF name -> tensor to write: DTensor shards as they are, this rank's experts as whole tensors."""
    head_dim, n = cfg.attention_head_dim(), cfg.moe.expert_hidden
    order = torch.argsort(rope_permutation(head_dim))  # interleaved -> half
    state: dict[str, Tensor] = {}
    for ours, theirs in family.tensor_names(cfg).items():
        tensor = tensors[ours].detach()
        if _needs_rope_reorder(cfg, ours):
            tensor = rope_reorder(full(tensor), head_dim, order)
        state[theirs] = tensor.to(torch.float32 if theirs.endswith(family.float32_names) else dtype)
    for theirs, ours in _shared_copies(family, cfg).items():  # a tensor of its own under each name
        state[theirs] = tensors[ours].detach().to(dtype).clone()
    for layer, moe in routed_layers(cfg):
        w1 = by_rows(tensors[f"{moe}.experts.w1"].detach())
        w2 = by_rows(tensors[f"{moe}.experts.w2"].detach())
        if family.interleaved_expert_names is not None:
            gate_up, gate_up_bias, down, down_bias = family.interleaved_expert_names(layer)
            state[gate_up] = _interleaved(w1, n).to(dtype)
            state[down] = w2.to(dtype)
            if cfg.moe.expert_proj_bias:
                b1 = by_rows(tensors[f"{moe}.experts.b1"].detach())
                state[gate_up_bias] = _interleaved(b1, n).to(dtype)
                state[down_bias] = by_rows(tensors[f"{moe}.experts.b2"].detach()).to(dtype)
            continue
        local_w1, first = local_rows(w1)
        local_w2, _ = local_rows(w2)
        for row in range(local_w1.shape[0]):
            gate, up, down = family.expert_names(layer, first + row)
            state[gate] = local_w1[row, :, :n].T.contiguous().to(dtype)
            state[up] = local_w1[row, :, n:].T.contiguous().to(dtype)
            state[down] = local_w2[row].T.contiguous().to(dtype)
    return state


def check_output_dir(out_dir: str | Path) -> Path:
    """--out of an export: new or empty, and creatable here (one ConfigError line otherwise; nothing is left)."""
    out = Path(out_dir)
    try:
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ConfigError(f"--out {str(out)!r} already exists and is not an empty directory; choose a new one")
        parent = out.absolute()
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir():
            raise ConfigError(f"--out {str(out)!r} is below {str(parent)!r}, which is a file, not a directory")
        # Try it: permissions, a read-only mount and pseudo file systems (/proc) all say no only to a write.
        shutil.rmtree(tempfile.mkdtemp(prefix=".moetrain-probe-", dir=parent))
    except OSError as err:
        raise ConfigError(f"--out {str(out)!r} cannot be written: {err.strerror or err} "
                          f"({err.filename or out}); choose another directory") from None
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
    family_name = export_family(cfg.model)
    family = families.family(family_name)
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"data.tokenizer = {cfg.data.tokenizer!r} has {tokenizer.vocab_size} ids, more than "
                          f"model.vocab_size = {cfg.model.vocab_size}: the exported directory would not be usable")
    out = check_output_dir(out_dir)
    rank, _ = rank_and_world()
    dtype = dtype or next(model.parameters()).dtype
    tensors = _model_tensors(model)
    state = _export_tensors(family, cfg.model, tensors, dtype)
    shapes = expected_shapes(family, cfg.model, tensors)
    index = _file_index(shapes, torch.empty((), dtype=dtype).element_size(), max_file_bytes)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    barrier()
    if distributed():
        writer = HuggingFaceStorageWriter(str(out), fqn_to_index_mapping=index, save_distributed=True,
                                          enable_consolidation=True)
        dcp.save(state, storage_writer=writer)
        barrier()
        if rank == 0:
            shutil.rmtree(out / "sharded", ignore_errors=True)  # the per-rank pieces, now consolidated
    else:
        with _quiet_single_process():
            dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(out), fqn_to_index_mapping=index),
                     no_dist=True)
    if rank == 0:
        config = hf_config(cfg.model, family_name, tokenizer, dtype)
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        _write_tokenizer(cfg.data.tokenizer, tokenizer, out)
        _write_chat_files(cfg.data.tokenizer, cfg.data.chat_template, tokenizer, out)
    barrier()
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


def _write_chat_files(spec: str, template_file: str | None, tokenizer: Tokenizer, out: Path) -> None:
    """The chat template (chat_template.jinja), a tokenizer_config.json when the source had none, and a
    generation_config.json whose EOS ids include the template's end-of-turn token, so `transformers`
    chats with the directory and stops at the end of the assistant's turn."""
    if spec == "byte" or not isinstance(tokenizer, HFTokenizer):
        return
    source = Path(spec) if Path(spec).is_dir() else Path(spec).parent
    try:
        template = load_chat_template(str(source), template_file)
    except ConfigError:
        template = None  # a tokenizer without a chat template: plain text continuation, nothing to add
    if not (out / "tokenizer_config.json").is_file():
        names = {name: tokenizer.token_text(i) for name, i in
                 (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id), ("pad_token", tokenizer.pad_id))
                 if tokenizer.token_text(i) is not None}
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **names, "model_max_length": 1 << 30}
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    eos = [tokenizer.eos_id]
    if template is not None:
        (out / "chat_template.jinja").write_text(template.text, encoding="utf-8")
        try:
            end_of_turn = end_of_turn_ids(template, tokenizer.encode_with_offsets, tokenizer.special_token_ids())
        except ConversationError:  # a template that cannot render a one-exchange chat: EOS alone stops generation
            end_of_turn = []
        eos += [i for i in end_of_turn if i not in eos]
    generation = {"bos_token_id": tokenizer.bos_id, "eos_token_id": eos if len(eos) > 1 else eos[0],
                  "pad_token_id": tokenizer.pad_id}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
