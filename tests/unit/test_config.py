"""Config loading, overrides and validation: every bad input is one ConfigError line."""

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from moetrain.config.job import JobConfig, load, parse_job_args
from moetrain.config.parallel import ParallelConfig, check_world_size
from moetrain.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_moe.toml")


def test_default_config_file_loads():
    cfg = load(TINY)
    assert cfg.model.moe.n_experts == 16 and cfg.data.source == "stdlib"


def test_overrides_are_typed():
    cfg = parse_job_args(["--config", TINY, "--train.steps", "50", "--parallel.dp_replicate", "2",
                          "--train.compile", "True", "--model.n_kv_heads", "2", "--train.lr", "1e-3"])
    assert (cfg.train.steps, cfg.parallel.dp_replicate, cfg.train.compile, cfg.model.n_kv_heads) == (50, 2, True, 2)
    assert cfg.train.lr == pytest.approx(1e-3)


BAD_OVERRIDES = [
    (["--train.lr", "-0.1"], "train.lr"),
    (["--train.steps", "0"], "train.steps"),
    (["--train.steps", "ten"], "--train.steps"),
    (["--train.nonexistent", "1"], "unknown option --train.nonexistent"),
    (["--model.moe.top_k", "17"], "model.moe.top_k"),
    (["--model.moe.score_func", "relu"], "score_func"),
    (["--model.n_heads", "3"], "model.n_heads"),
    (["--model.n_heads", "32", "--model.dim", "96"], "model.n_heads"),
    (["--model.n_kv_heads", "3"], "model.n_kv_heads"),
    (["--model.n_dense_layers", "5"], "model.n_dense_layers"),
    (["--data.seq_len", "1024"], "data.seq_len"),
    (["--data.source", "dir"], "data.path"),
    (["--data.heldout_fraction", "1.5"], "data.heldout_fraction"),
    (["--train.beta2", "1.0"], "train.beta2"),
    (["--train.min_lr_ratio", "2"], "train.min_lr_ratio"),
    (["--parallel.dp_shard", "0"], "parallel.dp_shard"),
    (["--parallel.dp_replicate", "-2"], "parallel.dp_replicate"),
    (["--checkpoint.keep_last", "0"], "checkpoint.keep_last"),
    (["--model.moe.token_rounding_tile", "0"], "token_rounding_tile"),
    (["--train.grad_clip", "-1"], "train.grad_clip"),
    (["--model.moe.aux_loss_coef", "-0.5"], "aux_loss_coef"),
    (["--train.lr", "inf"], "train.lr = inf is invalid: must be a finite number"),
    (["--model.moe.aux_loss_coef", "inf"], "model.moe.aux_loss_coef = inf is invalid"),
    (["--train.max_consecutive_skips", "0"], "train.max_consecutive_skips"),
    (["--model.init_scale_embedding", "True"], "model.init_scale_embedding"),
]


@pytest.mark.parametrize("override,needle", BAD_OVERRIDES, ids=[" ".join(o) for o, _ in BAD_OVERRIDES])
def test_bad_override_is_one_line(override, needle):
    with pytest.raises(ConfigError) as info:
        parse_job_args(["--config", TINY, *override])
    message = str(info.value)
    assert needle in message and "\n" not in message


BAD_TOML = [
    ("[train]\nstepz = 3\n", "stepz"),
    ("[nosuchsection]\nx = 1\n", "nosuchsection"),
    ("[train]\nsteps = 'many'\n", "train.steps"),
    ("[train]\nlr = true\n", "train.lr"),
    ("[model.moe]\ntop_k = 2.5\n", "model.moe.top_k"),
    ("[train\nsteps = 3\n", "not valid TOML"),
    ("[train]\nsteps = true\n", "train.steps = True has the wrong type: expected int"),
    ("[model]\nn_kv_heads = false\n", "model.n_kv_heads = False has the wrong type"),
    ("[train]\nlr = inf\n", "train.lr = inf is invalid: must be a finite number"),
    ("[model.moe]\naux_loss_coef = -inf\n", "model.moe.aux_loss_coef = -inf is invalid"),
    ("[train]\nbeta1 = nan\n", "train.beta1 = nan is invalid"),
    ("[train]\nlr = 1e400\n", "train.lr = inf is invalid"),
    (b"[train]\nsample_prompt = 'caf\xe9'\n", "is not UTF-8 text"),
]


@pytest.mark.parametrize("text,needle", BAD_TOML)
def test_bad_toml_is_one_line(tmp_path, text, needle):
    path = tmp_path / "bad.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError) as info:
        load(path)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_int_accepted_for_float_field(tmp_path):
    path = tmp_path / "ok.toml"
    path.write_text("[train]\nlr = 1\n")
    assert load(path).train.lr == 1.0


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load("configs/does-not-exist.toml")


def test_every_float_field_is_checked_for_inf_and_nan():
    # Generic: every float field of the tree, including ones no range check names.
    def float_fields(obj, prefix=""):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                yield from float_fields(value, f"{prefix}{f.name}.")
            elif "float" in str(f.type):
                yield f"{prefix}{f.name}"

    names = list(float_fields(JobConfig()))
    assert {"train.lr", "model.moe.aux_loss_coef", "train.peak_flops", "model.clip_qkv"} <= set(names)
    for name in names:
        for bad in ("inf", "-inf", "nan"):
            with pytest.raises(ConfigError, match=f"^{re.escape(name)} = .* must be a finite number$"):
                parse_job_args(["--config", TINY, f"--{name}", bad])


def test_config_path_that_is_a_directory_or_unreadable(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"is a directory; pass a TOML file$"):
        load(tmp_path)
    path = tmp_path / "locked.toml"
    path.write_text("[train]\nsteps = 3\n")
    real_read_text = Path.read_text

    def read_text(self: Path, *args, **kwargs) -> str:
        # Permission bits do not stop root, so simulate the failure at the read itself.
        if self.name == "locked.toml":
            raise PermissionError(13, "Permission denied")
        return real_read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    with pytest.raises(ConfigError, match=r"^config file '.*locked.toml' is unreadable \(Permission denied\)$"):
        load(path)


@pytest.mark.parametrize("replicate,shard,world,expected", [(1, -1, 4, (1, 4)), (2, 2, 4, (2, 2)), (4, -1, 4, (4, 1)),
                                                            (1, -1, 1, (1, 1))])
def test_world_size_resolution(replicate, shard, world, expected):
    assert check_world_size(ParallelConfig(dp_replicate=replicate, dp_shard=shard), world) == expected


@pytest.mark.parametrize("replicate,shard,world", [(3, -1, 4), (2, 3, 4), (1, 2, 4)])
def test_mesh_not_matching_world_size(replicate, shard, world):
    with pytest.raises(ConfigError, match="world size"):
        check_world_size(ParallelConfig(dp_replicate=replicate, dp_shard=shard), world)


def test_defaults_validate():
    JobConfig().validate()


def test_cli_missing_config_exits_2_with_one_line():
    proc = subprocess.run([sys.executable, "-m", "moetrain", "train", "--config", "configs/does-not-exist.toml"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "does-not-exist.toml" in proc.stderr


def test_cli_bad_override_exits_2_with_one_line():
    proc = subprocess.run([sys.executable, "-m", "moetrain", "train", "--config", TINY, "--train.lr", "-1"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "train.lr" in proc.stderr


def test_cli_help_and_unknown_command():
    ok = subprocess.run([sys.executable, "-m", "moetrain", "--help"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "train" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "moetrain", "fly"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "valid commands" in bad.stderr


def test_compile_with_token_budget_batching_is_refused_in_one_line():
    base = JobConfig()
    packed = dataclasses.replace(base, train=dataclasses.replace(base.train, compile=True))
    packed.validate()
    budget = dataclasses.replace(packed, data=dataclasses.replace(base.data, batching="token_budget"))
    with pytest.raises(ConfigError, match=r"^data.batching = 'token_budget' is invalid: with train.compile = True"):
        budget.validate()


@pytest.mark.parametrize("pp,cp,tp,world,expected", [(2, 1, 1, 8, (1, 4)), (1, 2, 2, 8, (1, 2)), (2, 2, 2, 8, (1, 1))])
def test_world_size_leaves_data_ranks_after_pipeline_context_tensor(pp, cp, tp, world, expected):
    assert check_world_size(ParallelConfig(pp=pp, cp=cp, tp=tp), world) == expected


def test_world_size_not_divisible_by_model_dimensions():
    with pytest.raises(ConfigError, match="parallel.pp x parallel.cp x parallel.tp = 3 x 1 x 1 must divide"):
        check_world_size(ParallelConfig(pp=3), 4)


# Pipeline stages are tensor / context split like a whole model (tests/distributed/test_pipeline_tp_cp.py). Muon,
# QK-clip are checked under pipeline parallelism (tests/distributed/test_muon_dist.py), float8 too and rowwise
# float8 under cp (test_float8_split.py); MTP under every dimension
# (test_mtp_dist.py, test_mtp_split.py).
FEATURES = (("model.mtp_depth", 1), ("train.float8", "rowwise"), ("train.optimizer", "muon"),
            ("train.qk_clip_tau", 100.0), ("ft.enabled", True))
REFUSED_UNDER = {"model.mtp_depth": (), "train.float8": ("tp",),
                 "train.optimizer": (), "train.qk_clip_tau": (), "ft.enabled": ()}
LAYOUTS = (("pp",), ("tp",), ("cp",), ("pp", "tp"), ("pp", "cp"))
COMPOSED = [(layout, feature, value) for layout in LAYOUTS for feature, value in FEATURES]


def _composed_job(layout: tuple[str, ...]) -> JobConfig:
    cfg = JobConfig()
    cfg.model.tie_embeddings = False
    cfg.model.qk_norm = "none"
    cfg.model.moe.aux_loss_scope = "global_batch"
    cfg.train.grad_accum, cfg.train.sample_tokens = 4, 0
    for dimension in layout:
        setattr(cfg.parallel, dimension, 2)
    return cfg


def test_tensorwise_float8_under_cp_is_refused_with_its_reason():
    cfg = _composed_job(("cp",))
    cfg.train.float8 = "tensorwise"
    with pytest.raises(ConfigError, match=r"^train.float8 = 'tensorwise' is invalid: is not supported yet with "
                                          r"parallel.cp = 2 \(its per-tensor scales are amaxes over a rank's tokens"):
        cfg.validate()


def test_mtp_under_a_schedule_with_first_and_last_stage_on_one_rank_is_refused():
    cfg = _composed_job(("pp",))
    cfg.model.mtp_depth, cfg.parallel.pp_schedule, cfg.parallel.pp_stages_per_rank = 1, "ZBVZeroBubble", 2
    with pytest.raises(ConfigError, match=r"^model.mtp_depth = 1 is invalid: must be 0 with parallel.pp_schedule"):
        cfg.validate()


@pytest.mark.parametrize("layout,feature,value", COMPOSED)
def test_features_not_checked_under_a_model_dimension_are_refused_and_the_rest_accepted(layout, feature, value):
    cfg = _composed_job(layout)
    cfg.validate()  # the layout alone is fine
    section, name = feature.split(".")
    setattr(getattr(cfg, section), name, value)
    cfg.ft.lighthouse = "http://localhost:29510"  # read only with ft.enabled
    refusing = [dimension for dimension in layout if dimension in REFUSED_UNDER[feature]]
    if not refusing:
        cfg.validate()
        return
    with pytest.raises(ConfigError, match=f"{feature} = .* is not supported yet with parallel.{refusing[0]} = 2"):
        cfg.validate()


# LoRA: each pipeline stage holds (and reads from lora.init_from) its layers' adapters, TP splits them with their
# layers, CP changes no module (tests/distributed/test_lora_*.py); dropout is refused under TP only.
@pytest.mark.parametrize("layout", LAYOUTS)
def test_lora_runs_under_every_model_dimension_and_dropout_is_refused_under_tp(layout):
    cfg = _composed_job(layout)
    cfg.lora.rank, cfg.lora.init_from = 4, "adapter_dir"
    cfg.validate()
    cfg.lora.dropout, cfg.lora.targets = 0.1, ["attention"]  # PEFT applies dropout to module targets only
    if "tp" not in layout:
        cfg.validate()
        return
    with pytest.raises(ConfigError, match=r"^lora.dropout = 0.1 is invalid: must be 0 with parallel.tp = 2: "):
        cfg.validate()
