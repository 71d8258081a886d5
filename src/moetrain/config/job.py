"""The whole job (`JobConfig`): its eight sections, the rules across sections, and its TOML and CLI forms.

Each section validates its own fields (moetrain.config.model, .data, ...); here live only the rules
that read two sections, the TOML reading and writing, and `--section.field value` parsing (tyro).
Parallel sizes that depend on the world size are moetrain.config.parallel.check_world_size's.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import tomllib
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import dacite
import tyro

from moetrain.args import parse_typed_args, print_help, take_option
from moetrain.config.checkpoint import CheckpointConfig
from moetrain.config.checks import check, check_field_types, type_name
from moetrain.config.data import DataConfig
from moetrain.config.ft import FtConfig
from moetrain.config.logging import LoggingConfig
from moetrain.config.lora import LoraConfig, target_widths
from moetrain.config.model import ModelConfig
from moetrain.config.parallel import ParallelConfig, check_pipeline_job, check_sequence_split
from moetrain.config.profile import ProfileConfig
from moetrain.config.train import TrainConfig
from moetrain.errors import ConfigError


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    ft: FtConfig = field(default_factory=FtConfig)

    lora: LoraConfig = field(default_factory=LoraConfig)

    def validate(self) -> JobConfig:
        """Check every field's type, then each section's own rules, then the rules across sections;
        ConfigError (one line) names the first invalid field. Returns self."""
        check_field_types(self)
        for section in dataclasses.fields(self):
            getattr(self, section.name).validate()
        self._validate_across_sections()
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def _validate_across_sections(self) -> None:
        m, moe, p, d, t = self.model, self.model.moe, self.parallel, self.data, self.train
        if m.init_from is not None:
            _check_tokenizer_travels(m.init_from[3:], d.tokenizer)
        check(d.seq_len <= m.max_seq_len, "data.seq_len", d.seq_len, f"must be <= model.max_seq_len = {m.max_seq_len}")
        if d.token_budget is not None:
            # A piece of a long document is budget tokens long, so positions reach budget - 1.
            check(1 <= d.token_budget <= m.max_seq_len, "data.token_budget", d.token_budget,
                  f"must be in [1, model.max_seq_len = {m.max_seq_len}] or None (= data.seq_len)")
        # A bin's row is as long as its documents ([1, L], L <= budget), so compiled blocks with static shapes
        # would recompile for every new L.
        check(not (t.compile and d.batching == "token_budget"), "data.batching", d.batching,
              "with train.compile = True: each microbatch's row length differs (a recompile per length); "
              "use packed batching or train.compile = False")
        check_pipeline_job(p, n_layers=m.n_layers, grad_accum=t.grad_accum, tie_embeddings=m.tie_embeddings,
                           batching=d.batching, compile=t.compile, eval_tasks=bool(t.eval_tasks))
        check_sequence_split(p, m, d, t)
        _check_composed_features(self)
        _check_mtp_pipeline(self)
        if p.ep > 1:
            check(m.n_dense_layers < m.n_layers, "parallel.ep", p.ep,
                  f"expert parallelism needs an MoE layer, but all model.n_layers = {m.n_layers} layers are dense; "
                  "use 1")
            check(moe.n_experts % p.ep == 0, "parallel.ep", p.ep,
                  f"must divide model.moe.n_experts = {moe.n_experts} (each rank owns whole experts)")
        if self.ft.enabled:
            # torchft's managed group is the replicate dimension: inside a replica group nothing is replicated.
            check(p.dp_replicate == 1, "parallel.dp_replicate", p.dp_replicate,
                  "with ft.enabled = true: must be 1 (the replica groups are the replicate dimension)")
            check(not self.checkpoint.async_save, "checkpoint.async_save", self.checkpoint.async_save,
                  "with ft.enabled = true: must be false (a recovery must not race a background save)")
        if self.lora.enabled:
            _check_lora(self.lora, m, p)


# train.float8 refused under a mesh dimension, by (dimension, recipe) ("*": any recipe), with the reason.
FLOAT8_REFUSED = {
    ("parallel.tp", "*"): "torchao's float8 TP styles need every consumer of a prepared input to be a Float8Linear, "
                          "which MLA's high-precision wq_a / wkv_a are not",
    ("parallel.cp", "tensorwise"): "its per-tensor scales are amaxes over a rank's tokens: use rowwise",
}


def _check_composed_features(cfg: JobConfig) -> None:
    """Features each built and checked against one process on FSDP/HSDP and EP, but not yet under the newer
    mesh dimensions: refused in one line there rather than run unchecked."""
    p, t = cfg.parallel, cfg.train
    for name, degree in (("parallel.pp", p.pp), ("parallel.tp", p.tp), ("parallel.cp", p.cp)):
        if degree == 1:
            continue
        # MTP, Muon and QK-clip are checked under every dimension (tests/distributed: test_mtp_split.py,
        # test_muon_dist.py, test_muon_split.py); float8 under pp, and rowwise under cp (test_float8_split.py,
        # reasons in FLOAT8_REFUSED).
        refused = (None if t.float8 == "none"
                   else FLOAT8_REFUSED.get((name, t.float8)) or FLOAT8_REFUSED.get((name, "*")))
        check(refused is None, "train.float8", t.float8, f"is not supported yet with {name} = {degree} ({refused})")


def _check_mtp_pipeline(cfg: JobConfig) -> None:
    # The last stage embeds the tokens ahead with its own copy of the first stage's embedding; ZBVZeroBubble puts
    # both stages on one rank, where that copy would be the first stage's module under a second FSDP root.
    p = cfg.parallel
    check(not (cfg.model.mtp_depth > 0 and p.pp > 1 and p.pp_schedule == "ZBVZeroBubble"), "model.mtp_depth",
          cfg.model.mtp_depth, "must be 0 with parallel.pp_schedule = 'ZBVZeroBubble' (the first and last stages "
          "on one rank): use 1F1B or Interleaved1F1B")


def _check_lora(lora: LoraConfig, model: ModelConfig, parallel: ParallelConfig) -> None:
    # Every target must exist in this model and be at least `rank` wide: a rank past a matrix's smaller
    # dimension adds parameters that cannot raise the update's rank.
    widths = target_widths(model)
    for target in lora.targets:
        check(target in widths, "lora.targets", lora.targets, f"this model has no {target} to adapt")
    narrowest = min(lora.targets, key=widths.__getitem__)
    check(lora.rank <= widths[narrowest], "lora.rank", lora.rank,
          f"must be <= {widths[narrowest]}, the smallest dimension of the {narrowest} matrices")
    # Under pipeline, tensor and context parallelism the adapters live with their layers (gradients checked
    # against float64). Dropout on a column-wise adapter's gathered input would need the same mask on every
    # TP rank, which nothing here arranges: refused rather than unchecked.
    check(not (parallel.tp > 1 and lora.dropout > 0), "lora.dropout", lora.dropout,
          f"must be 0 with parallel.tp = {parallel.tp}: the TP ranks would drop different inputs of one adapter")
    moe = model.moe
    check(not (moe.load_balance == "aux_free" and moe.bias_update_rate > 0 and model.n_dense_layers < model.n_layers),
          "model.moe.bias_update_rate", moe.bias_update_rate, "must be 0 with lora.rank > 0: the aux-free balancing "
          "bias is base state, which LoRA keeps frozen and a PEFT adapter cannot carry")


def _check_tokenizer_travels(model_dir: str, tokenizer: str) -> None:
    # A model directory's tokenizer.json is the model's tokenizer: training it on other token ids
    # would silently mean something else, so the job must name it (the directory or the file).
    carried = Path(model_dir) / "tokenizer.json"
    if not carried.is_file():
        return
    named = Path(tokenizer)
    named = named / "tokenizer.json" if named.is_dir() else named
    check(named.is_file() and named.resolve() == carried.resolve(), "data.tokenizer", tokenizer,
          f"model.init_from = 'hf:{model_dir}' carries its tokenizer: use --data.tokenizer {model_dir}")


def _check_known_keys(data: Any, cls: type, where: str, prefix: str = "") -> None:
    # One line naming the section and the closest valid key (dacite names neither).
    if not isinstance(data, dict):
        return
    hints = typing.get_type_hints(cls)
    for key, value in data.items():
        if key in hints:
            if dataclasses.is_dataclass(hints[key]):
                _check_known_keys(value, hints[key], where, f"{prefix}{key}.")
            continue
        section = f"[{prefix[:-1]}]" if prefix else "the top level"
        close = difflib.get_close_matches(str(key), list(hints), n=1)
        hint = f"did you mean {prefix}{close[0]}? " if close else ""
        raise ConfigError(f"{where}: unknown key {prefix}{key} in {section}; {hint}valid keys there: "
                          f"{', '.join(hints)}")


def from_dict(data: dict[str, Any], where: str = "config") -> JobConfig:
    """Build a JobConfig from nested dicts, rejecting unknown keys and wrong types."""
    _check_known_keys(data, JobConfig, where)
    try:
        return dacite.from_dict(JobConfig, _ints_to_floats(data, JobConfig), config=dacite.Config(strict=True))
    except dacite.UnexpectedDataError as err:
        raise ConfigError(f"unknown config key(s) {sorted(err.keys)}; valid keys are the fields of "
                          "moetrain.config.JobConfig") from None
    except dacite.WrongTypeError as err:
        expected = type_name(err.field_type)
        raise ConfigError(f"{err.field_path} = {err.value!r} has the wrong type: expected {expected}") from None
    except dacite.DaciteError as err:
        raise ConfigError(f"bad config: {err}") from None


def _ints_to_floats(data: Any, cls: type, prefix: str = "") -> Any:
    # TOML writes 1 for 1.0: turn ints into floats where the field is a float. dacite
    # accepts bools as numbers, so they are rejected here, by field name.
    if not isinstance(data, dict):
        return data
    hints = typing.get_type_hints(cls)
    out = dict(data)
    for key, value in data.items():
        hint = hints.get(key)
        if dataclasses.is_dataclass(hint):
            out[key] = _ints_to_floats(value, hint, f"{prefix}{key}.")
        elif float in (hint, *typing.get_args(hint)):
            if isinstance(value, bool):
                raise ConfigError(f"{prefix}{key} = {value!r} has the wrong type: expected a number")
            if type(value) is int:
                out[key] = float(value)
    return out


def load(path: str | Path) -> JobConfig:
    """Load and validate a TOML config file."""
    return from_dict(read_toml(path), str(path)).validate()


def read_toml(path: str | Path) -> dict[str, Any]:
    """A TOML config file's contents as nested dicts, or one ConfigError line saying why not."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {str(path)!r} is a directory; pass a TOML file")
    if not path.exists():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    if not path.is_file():  # a FIFO or device: reading it would block or never end
        raise ConfigError(f"config file {str(path)!r} is not a regular file; pass a TOML file")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"config file {str(path)!r} is unreadable ({err.strerror or type(err).__name__})") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (bad byte at offset {err.start})") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {err}") from None
    return data


def apply_overrides(cfg: JobConfig, args: list[str], prog: str = "moetrain train") -> JobConfig:
    """Apply `--section.field value` command-line overrides (typed by tyro) and re-validate."""
    if not args:
        return cfg.validate()
    return parse_typed_args(JobConfig, args, prog, default=cfg).validate()


def to_toml(cfg: JobConfig, comments: dict[str, str] | None = None) -> str:
    """`cfg` as a TOML job file (`None` fields left out, as a comment); `comments`: "section.field" -> text
    written above that field."""
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)  # a JSON string is a TOML basic string
        return repr(v)

    def section(obj: Any, name: str) -> list[str]:
        rows, nested = [f"[{name}]"], []
        for f in dataclasses.fields(obj):
            v, path = getattr(obj, f.name), f"{name}.{f.name}"
            if dataclasses.is_dataclass(v):
                nested.append((v, path))
                continue
            for line in (comments or {}).get(path, "").splitlines():
                rows.append(f"# {line}".rstrip())
            rows.append(f"# {f.name} = (none)" if v is None else f"{f.name} = {value(v)}")
        for v, path in nested:
            rows += ["", *section(v, path)]
        return rows

    out: list[str] = []
    for f in dataclasses.fields(cfg):
        out += [*section(getattr(cfg, f.name), f.name), ""]
    return "\n".join(out)


@dataclass(frozen=True)
class CommandOption:
    """An option a job command (train, bench train, estimate) reads beside the job's fields, for its --help."""

    name: str
    type: Any
    default: Any
    help: str


CONFIG_OPTION_HELP = ("TOML job file; its values are the defaults the --section.field options override "
                      "(none = the built-in defaults)")


def print_job_help(prog: str, description: str, options: Sequence[CommandOption] = ()) -> None:
    """`prog --help`: --config, the command's own options, then every job field (each with its docstring)."""
    fields: list[Any] = [("config", Annotated[str | None, tyro.conf.arg(help=CONFIG_OPTION_HELP, metavar="FILE")],
                          None)]
    fields += [(o.name, Annotated[o.type, tyro.conf.arg(help=o.help)], o.default) for o in options]
    fields.append(("job", Annotated[JobConfig, tyro.conf.arg(name=""), tyro.conf.FlagConversionOff],
                   field(default_factory=JobConfig)))
    command_line = dataclasses.make_dataclass("JobCommandLine", fields)
    command_line.__doc__ = description
    print_help(command_line, prog, bool_flags=True)  # the command's booleans are flags; the job's take values


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def parse_job_args(argv: list[str], prog: str = "moetrain train",
                   init_from_defaults: Callable[[str], JobConfig] | None = None,
                   description: str = "", options: Sequence[CommandOption] = ()) -> JobConfig:
    """`--config PATH [--section.field value ...]` -> validated JobConfig (`--help`: print_job_help).

    With `init_from_defaults` and a `model.init_from` (TOML or command line), the job's defaults are
    `init_from_defaults(value)` (a Hugging Face directory's architecture and tokenizer) instead of the
    built-in ones: what the TOML and the options set explicitly still wins, and is checked against the
    directory when the model is built.
    """
    if any(a in ("-h", "--help") for a in argv):
        print_job_help(prog, description, options)
    config_path, rest = take_option(argv, "config")
    data = read_toml(config_path) if config_path else {}
    init_from, _ = take_option(rest, "model.init_from")
    if init_from is None and isinstance(data.get("model"), dict):
        init_from = data["model"].get("init_from")
    if init_from_defaults is not None and isinstance(init_from, str) and init_from.startswith("hf:"):
        base = init_from_defaults(init_from).to_dict()
        data = _merge({"model": base["model"], "data": {k: base["data"][k] for k in ("tokenizer", "seq_len")}}, data)
    return apply_overrides(from_dict(data, config_path or "config"), rest, prog=prog)
