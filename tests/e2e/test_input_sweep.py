"""The input sweep (benchmarks/stress/input_sweep.py) over the commands that do not train: no case ends in a traceback.

The whole sweep (train included, ~400 cases) is the benchmark script; here the commands whose cases
take milliseconds to a second each: sample, plot, export-hf, data prepare, simulate, init-report.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from conftest import tiny_job_args
from moetrain import cli
from moetrain.config.job import parse_job_args
from moetrain.logging import setup_logging
from moetrain.testing.cli_sweep import (
    Accepted,
    Option,
    Outcome,
    bad_files,
    bad_toml_values,
    bad_values,
    command_options,
    memoized_source,
    run_case,
    snapshot,
    toml_lines,
)

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "stress" / "input_sweep.py"
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
FAST = ("sample", "plot", "export-hf", "data ", "simulate", "init-report", "unknown", "bench")


def test_no_input_of_the_fast_commands_ends_in_a_traceback(tmp_path):
    spec = importlib.util.spec_from_file_location("input_sweep", SCRIPT)
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    fixtures = sweep.build_fixtures(tmp_path)
    log_dir = tmp_path / "stderr"
    log_dir.mkdir()
    results = [(name, sweep.run_case(argv, 60.0, log_dir, i))
               for i, (name, argv) in enumerate(sweep.cases(fixtures)) if name.startswith(FAST)]
    assert len(results) > 100
    failed = [(name, r["outcome"], r["answer"]) for name, r in results if not r["ok"]]
    assert not failed, failed
    refused = [r for _, r in results if r["code"] == 2]
    assert [r["answer"] for r in refused if not r["answer"].startswith("moetrain: error:")] == []


# ---------------------------------------------------------------------------------------------------
# Bad inputs found by hand, one row each: (name, build(tmp) -> argv, what the one line must name). Each must
# end in exit 2 with one `moetrain: error:` line and leave nothing half-written (`out` absent or without a
# manifest). Add a row for every new one.


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _texts(tmp: Path, n: int = 30) -> Path:
    return _jsonl(tmp / "texts.jsonl", [{"text": f"document {i} " * 5} for i in range(n)])


def _oov_shards(tmp: Path) -> list[str]:
    """Prepared shards whose ids reach past the byte tokenizer's 259, checksums and manifest made consistent."""
    out = tmp / "shards"
    assert cli.main(["data", "prepare", "--input", str(_texts(tmp)), "--out", str(out), "--quiet"]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    entry = manifest["splits"]["train"][0]
    tokens_path = out / entry["files"]["tokens"]
    tokens = np.load(tokens_path)
    tokens[5] = 300
    np.save(tokens_path, tokens)
    entry["sha256"]["tokens"] = hashlib.sha256(tokens_path.read_bytes()).hexdigest()
    (out / "train" / "shard_00000.json").write_text(json.dumps(entry))
    (out / "manifest.json").write_text(json.dumps(manifest))
    run = tmp / "run"
    return ["train", "--config", str(CONFIGS / "tiny_moe.toml"), "--data.source", "tokens", "--data.path", str(out),
            "--model.dim", "32", "--model.n_layers", "2", "--model.n_heads", "2", "--model.ffn_hidden", "32",
            "--model.moe.n_experts", "4", "--model.moe.expert_hidden", "16", "--data.seq_len", "32",
            "--train.steps", "2", "--train.warmup_steps", "1", "--train.eval_every", "0", "--train.sample_tokens", "0",
            "--train.num_threads", "1",
            "--logging.run_dir", str(run), "--logging.progress_bar", "False"]


def _hf_dir(tmp: Path, **changes) -> Path:
    import hf_tiny

    directory = tmp / "hf"
    directory.mkdir()
    config = hf_tiny.config("deepseek_v3").to_dict()
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def _raw_config(tmp: Path, text: str) -> Path:
    directory = tmp / "hf"
    directory.mkdir()
    (directory / "config.json").write_text(text)
    return directory


def _parquet(tmp: Path, values: list, name: str = "rows.parquet") -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp / name
    pq.write_table(pa.table({"text": values}), path)
    return path


def _corrupt_parquet(tmp: Path) -> Path:
    path = _parquet(tmp, [f"document {i} " * 40 for i in range(200)])
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle: middle + 64] = bytes(64)
    path.write_bytes(bytes(data))
    return path


def _two_shards_same_tensor(tmp: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    directory = _hf_dir(tmp)
    tensor = {"model.embed_tokens.weight": torch.zeros(4, 4)}
    save_file(tensor, str(directory / "model-00001-of-00002.safetensors"))
    save_file(tensor, str(directory / "model-00002-of-00002.safetensors"))
    return directory


def _prepare(source: Path, tmp: Path, *extra: str) -> list[str]:
    return ["data", "prepare", "--input", str(source), "--out", str(tmp / "out"), "--quiet", *extra]


BAD_INPUTS = [
    ("train: out-of-vocabulary ids in consistent token shards", _oov_shards, "holds token id 300"),
    ("config --from-hf: Infinity in a size field",
     lambda t: ["config", "--from-hf", str(_raw_config(t, '{"model_type": "deepseek_v3", "hidden_size": Infinity}'))],
     "Infinity"),
    ("config --from-hf: 100,000 nested [ in config.json",
     lambda t: ["config", "--from-hf", str(_raw_config(t, "[" * 100_000))], "nested too deeply"),
    ("config --from-hf: n_group 2.5", lambda t: ["config", "--from-hf", str(_hf_dir(t, n_group=2.5))], "n_group"),
    ("data prepare --streaming: a truncated JSON Lines file",
     lambda t: _prepare(_truncated(t), t, "--streaming"), "texts.jsonl"),
    ("data prepare: a Parquet text column of integers", lambda t: _prepare(_parquet(t, list(range(20))), t),
     "rows.parquet"),
    ("data prepare: a JSON Lines row whose text is not a string",
     lambda t: _prepare(_jsonl(t / "mixed.jsonl", [{"text": "fine"}, {"text": 7}, {"text": "also fine"}]), t),
     "mixed.jsonl:2 is not"),
    ("data prepare: every record skipped",
     lambda t: _prepare(_jsonl(t / "chats.jsonl", [{"messages": []}] * 3), t, "--format", "chat", "--tokenizer",
                        str(_chat_tokenizer(t)), "--skip-bad-files"), "skipped every record (3"),
    ("data prepare: a corrupted Parquet column chunk", lambda t: _prepare(_corrupt_parquet(t), t), "rows.parquet"),
    ("train --model.init_from: a tensor in two shards without an index",
     lambda t: ["train", "--model.init_from", f"hf:{_two_shards_same_tensor(t)}", "--logging.run_dir", str(t / "run"),
                "--train.steps", "1", "--train.warmup_steps", "0", "--data.seq_len", "16"],
     "tensor model.embed_tokens.weight is in both"),
    ("sample: one unknown option beside a dashed valid one",
     lambda t: ["sample", "--run-dir", str(t), "--bogus", "1"], "unknown option --bogus ("),
]


def _truncated(tmp: Path) -> Path:
    path = _texts(tmp, 50)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 17])  # the last record cut in the middle of its string
    return path


def _chat_tokenizer(tmp: Path) -> Path:
    from chat_fixtures import TEMPLATES, tokenizer_dir

    return tokenizer_dir(tmp / "tok", TEMPLATES["qwen_chatml"])


@pytest.mark.parametrize("case", [row[0] for row in BAD_INPUTS])
def test_a_bad_input_is_one_line_exit_2_and_nothing_half_written(case, tmp_path, capsys):
    _, build, named = next(row for row in BAD_INPUTS if row[0] == case)
    argv = build(tmp_path)
    capsys.readouterr()
    setup_logging()  # log lines to this test's stderr (a run of an earlier test left its own, now closed)
    code = cli.main(argv)
    # (log lines and the datasets library's own progress lines are not answers)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "WARNING" not in line
           and " INFO " not in line and not line.startswith("Generating ")]
    assert code == 2 and len(err) == 1 and err[0].startswith("moetrain: error:") and named in err[0], (code, err)
    assert not (tmp_path / "out" / "manifest.json").exists()


# ---------------------------------------------------------------------------------------------------
# The whole-CLI sweep, generated: each command's options are read from the parser the command builds
# (moetrain.testing.cli_sweep.command_options: a new option is swept without being listed), each paired
# with the bad values of its kind; each file option below with the bad file kinds. Every case must end in
# exit 2 with exactly one `moetrain: error:` line naming the option or the file, and leave the case's
# directory unchanged. A command stops before its work: either its base command line points its main
# input at SENTINEL (a missing path: an accepted value then ends in the one line about SENTINEL) or a
# hook replaces the function that starts the work. A case that reaches either was accepted, which fails
# unless ACCEPTED lists it with the reason the value is valid.

SENTINEL = "/nonexistent/moetrain-sweep-input"


@dataclass(frozen=True)
class Command:
    words: tuple[str, ...]
    base: Callable[[dict[str, str]], list[str]]  # fixtures -> the rest of a command line that stops cheaply
    hooks: tuple[str, ...] = ()  # "module:function" reached only once every option was accepted
    inputs: tuple[str, ...] = ()  # options naming a file or directory to read ("hf:" forms: see PREFIXED)
    outputs: tuple[str, ...] = ()  # options naming a place to write
    owns_job_fields: bool = True  # False: the job's --section.field options are the same parser's as train's
    file_base: Callable[[dict[str, str]], list[str]] | None = None  # the base of the file cases, when not `base`


def _tiny_train(f: dict[str, str]) -> list[str]:
    """The tiny job as one TOML file (`--config` alone: no override for tyro to parse, milliseconds a case)."""
    return ["--config", f["tiny_job"]]


REPO_CONFIG = str(CONFIGS / "tiny_moe.toml")

COMMANDS = [
    Command(("train",), _tiny_train, hooks=("moetrain.train.run:Trainer",), inputs=("--config",)),
    Command(("estimate",), lambda f: [*_tiny_train(f), "--skip-data"], owns_job_fields=False,
            hooks=("moetrain.commands.estimate:describe", "moetrain.commands.estimate:proposals")),
    Command(("bench", "train"), _tiny_train, hooks=("moetrain.bench.train:measure",), owns_job_fields=False,
            outputs=("--json",)),
    Command(("sample",), lambda f: ["--run-dir", SENTINEL], inputs=("--run_dir",)),
    Command(("plot",), lambda f: [f["metrics_run"], "--out", f"{f['case']}/curve.png"], inputs=("run_dir",),
            outputs=("--out",)),
    Command(("export-hf",), lambda f: ["--run-dir", SENTINEL, "--out", f"{f['case']}/hf"], inputs=("--run_dir",)),
    Command(("data", "prepare"), lambda f: ["--input", SENTINEL, "--out", f"{f['case']}/shards", "--quiet"],
            inputs=("--input", "--tokenizer", "--chat_template"), outputs=("--out",),
            file_base=lambda f: ["--input", f["corpus"], "--out", f"{f['case']}/shards", "--quiet"]),
    Command(("config",), lambda f: ["--from-hf", SENTINEL], inputs=("--from_hf",)),
    Command(("eval",), lambda f: ["--tasks", f["task"], "--run-dir", SENTINEL, "--out", f"{f['case']}/eval.json"],
            inputs=("--run_dir", "--include"), outputs=("--out",)),
    Command(("simulate",), lambda f: ["--samples", "20"], hooks=("moetrain.bench.simulate:predict",),
            inputs=("--trace",), outputs=("--json", "--figure")),
    Command(("init-report",), lambda f: [], hooks=("moetrain.commands.init_report:build_initialised",),
            inputs=("--config",)),
    Command(("lighthouse",), lambda f: [], hooks=("moetrain.commands.lighthouse:start_lighthouse",)),
    Command(("bench", "moe"), lambda f: [], hooks=("moetrain.bench.moe:run_preset",), outputs=("--json", "--out_dir")),
    Command(("bench", "sync"), lambda f: [], hooks=("moetrain.bench.sync:run_on_ranks",),
            inputs=("--summarize",), outputs=("--json", "--figure")),
    Command(("bench", "ep"), lambda f: ["--config", REPO_CONFIG], hooks=("moetrain.bench.ep:run_on_ranks",),
            inputs=("--config", "--report"), outputs=("--json",)),
    Command(("bench", "attention"), lambda f: [], hooks=("moetrain.bench.attention:run_mix",),
            outputs=("--out_dir",)),
    Command(("bench", "data"), lambda f: ["--config", REPO_CONFIG], hooks=("moetrain.bench.data:run",),
            inputs=("--config",), outputs=("--work_dir", "--json")),
]
# The job's file fields: the bad files reach them through the TOML job file (the command line hands tyro the
# same string). The "hf:" form of model.init_from gets its prefix.
JOB_INPUTS = ("data.path", "data.tokenizer", "model.init_from", "data.chat_template", "lora.init_from")
JOB_OUTPUTS = ("logging.run_dir",)
PREFIXED = {"model.init_from": "hf:"}

# (command, option, what is wrong) -> why the command rightly accepts it. Grows with each command.
TORCH_SEED = "torch generators take any 64-bit seed, negative ones included"
ACCEPTED: dict[tuple[str, str, str], str] = {
    ("train", "--train.seed", "negative"): TORCH_SEED,
    ("train", "--train.seed", "TOML negative"): TORCH_SEED,
    ("sample", "--seed", "negative"): TORCH_SEED,
    ("init-report", "--seed", "negative"): TORCH_SEED,
    ("bench moe", "--seed", "negative"): TORCH_SEED,
    ("bench attention", "--seed", "negative"): TORCH_SEED,
    ("bench ep", "--seed", "negative"): TORCH_SEED,
    ("train", "--parallel.dp_shard", "negative"): "-1 is 'the rest of the world size' (the default)",
    ("train", "--parallel.dp_shard", "TOML negative"): "-1 is 'the rest of the world size' (the default)",
}


FULL = os.environ.get("MOETRAIN_SWEEP") == "full"


def _sweep_cases(command: Command, fixtures: dict[str, str]) -> list[tuple[str, str, str, list[str]]]:
    """(option, what is wrong, the bad value, command line) of every case of `command`.

    A file option gets the bad file kinds, not the bad strings. The suite runs each option with one bad value
    of its kind (rotating through the kind's list, so each kind is met), and the job's --section.field options
    on the command line only for the first field of each kind: tyro's conversion is per type, and every field
    meets the values of its kind through the TOML file (_toml_cases). MOETRAIN_SWEEP=full runs
    every option with every value (docs/results.md counts that sweep)."""
    words, base = list(command.words), command.base(fixtures)
    cases, seen_job_kinds = [], set()
    for index, option in enumerate(command_options(cli.main, words)):
        if option.kind in ("flag", "positional") or set(option.names) & set(command.inputs + command.outputs):
            continue
        values = bad_values(option)
        if "." in option.name and not command.owns_job_fields:  # the same parser's fields as train's
            continue
        if "." in option.name and not FULL:  # a job field: the TOML sweep meets every value
            if (option.kind, option.many) in seen_job_kinds:
                continue
            seen_job_kinds.add((option.kind, option.many))
        if values and not FULL:
            values = [values[index % len(values)]]
        cases += [(option.name, what, value, [*words, *base, option.name, value]) for what, value in values]
    files = bad_files(Path(fixtures["files"]))
    file_base = (command.file_base or command.base)(fixtures)
    for name in command.inputs + command.outputs:
        kinds = files["input"] if name in command.inputs else files["output"]
        for what, path in kinds.items():
            cases.append((name, what, path, [*words, *_replaced(file_base, name, path)]))
    return cases


def _toml_cases(fixtures: dict[str, str]) -> list[tuple[str, str, str, list[str]]]:
    """Each job field with a bad value of its kind (rotating; MOETRAIN_SWEEP=full: every value) in a TOML job
    file given to `train --config` alone (no command-line override, so no tyro parse: milliseconds a case)."""
    base = {line.split(" = ")[0]: line for line in Path(fixtures["tiny_job"]).read_text().splitlines()}
    out = Path(fixtures["root"]) / "toml"
    out.mkdir(exist_ok=True)
    cases = []

    def case(option: str, what: str, field: str, value: str, named: str) -> None:
        path = out / f"{field}-{len(cases)}.toml"
        path.write_text("\n".join([*(line for key, line in base.items() if key != field), f"{field} = {value}"]))
        cases.append((option, f"TOML {what}", named or str(path), ["train", "--config", str(path)]))

    for option in command_options(cli.main, ["train"]):
        if "." not in option.name or option.kind in ("flag", "positional") or option.name[2:] in JOB_INPUTS:
            continue
        values = bad_toml_values(option)
        for what, value in values if FULL else values[len(cases) % len(values):][:1]:
            case(option.name, what, option.name[2:], value, "")
    files = bad_files(Path(fixtures["files"]))
    for field in JOB_INPUTS + JOB_OUTPUTS:
        for what, path in files["input" if field in JOB_INPUTS else "output"].items():
            case(f"--{field}", what, field, json.dumps(PREFIXED.get(field, "") + path), path)
    return cases


def _replaced(base: list[str], name: str, value: str) -> list[str]:
    """`base` with option `name` (any spelling; a positional when it has no dashes) set to `value`."""
    if not name.startswith("-"):  # the positional: the base's first word
        return [value, *base[1:]]
    spellings = {name, name.replace("_", "-"), name.replace("-", "_")}
    out, skip = [], False
    for arg in base:
        if skip:
            skip = False
            continue
        if arg in spellings:
            skip = True
            continue
        out.append(arg)
    return [*out, name, value]


def _verdict(outcome: Outcome, option: Option | None, value: str, changed: list[str]) -> str:
    """'' when the case was refused as it must be, 'accepted' when the command took it, else what went wrong."""
    if outcome.escaped:
        return outcome.escaped
    if outcome.accepted or outcome.code == 0 or (outcome.code == 2 and len(outcome.lines) == 1
                                                 and SENTINEL in outcome.lines[0]):
        return "accepted"
    line = outcome.lines[0] if len(outcome.lines) == 1 else ""
    named = line and ((option is not None and option.named_in(line)) or value in line or repr(value)[1:-1] in line)
    if outcome.code != 2 or not line.startswith("moetrain: error:") or not named:
        return outcome.describe()
    return f"wrote {changed[:3]}" if changed else ""


def sweep_command(command: Command, fixtures: dict[str, str], monkeypatch) -> list[tuple[str, str, str]]:
    """(option, what is wrong, verdict) of every case of `command` (train: and of the TOML job file);
    the verdict is '' for a right refusal."""
    def stop(*args, **kwargs):
        raise Accepted

    for hook in command.hooks:
        module, function = hook.split(":")
        monkeypatch.setattr(importlib.import_module(module), function, stop)
    options = {name: option for option in command_options(cli.main, list(command.words)) for name in option.names}
    watched = [Path(fixtures["case"]), Path(fixtures["files"])]  # where outputs land, and the bad files
    cases = _sweep_cases(command, fixtures) + (_toml_cases(fixtures) if command.words == ("train",) else [])
    with memoized_source():
        return [_judged(command, options, watched, *case) for case in cases]


def _judged(command: Command, options: dict[str, Option], watched: list[Path], name: str, what: str, value: str,
            argv: list[str]) -> tuple[str, str, str]:
    before = {path: stat for root in watched for path, stat in snapshot(root).items()}
    outcome = run_case(cli.main, argv, timeout_s=30.0)
    after = {path: stat for root in watched for path, stat in snapshot(root).items()}
    changed = sorted(path for path in before.keys() | after.keys() if before.get(path) != after.get(path))
    verdict = _verdict(outcome, options.get(name), value, changed)
    if verdict == "accepted" and (" ".join(command.words), name, what) in ACCEPTED:
        verdict = ""
    return name, what, verdict


@pytest.fixture(scope="module")
def sweep_fixtures(tmp_path_factory, corpus_dir) -> dict[str, str]:
    return build_sweep_fixtures(tmp_path_factory.mktemp("sweep"), corpus_dir)


def build_sweep_fixtures(root: Path, corpus_dir: Path) -> dict[str, str]:
    """The sweep's files under `root`: the bad files, a run's metrics for `plot`, the tiny job as TOML."""
    (root / "case").mkdir()
    bad_files(root / "files")
    metrics_run = root / "metrics_run"  # what `plot` reads: a run's metrics file, two training records
    metrics_run.mkdir()
    (metrics_run / "metrics.jsonl").write_text("".join(
        json.dumps({"kind": "train", "step": step, "loss": 5.0 - step, "tokens_per_s": 100.0}) + "\n"
        for step in (1, 2)))
    tiny_job = root / "tiny_job.toml"
    job = parse_job_args(tiny_job_args(corpus_dir, root / "case" / "run"))
    tiny_job.write_text("\n".join(toml_lines(job.to_dict())))
    return {"root": str(root), "case": str(root / "case"), "files": str(root / "files"), "corpus": str(corpus_dir),
            "metrics_run": str(metrics_run), "tiny_job": str(tiny_job),
            "task": str(Path(__file__).resolve().parents[1] / "data" / "tasks" / "tiny_choice.jsonl")}


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c.words))
def test_every_option_and_file_of_every_command_is_refused_in_one_line(command, sweep_fixtures, monkeypatch):
    monkeypatch.chdir(sweep_fixtures["case"])  # a default output path lands where the snapshot sees it
    results = sweep_command(command, sweep_fixtures, monkeypatch)
    assert results
    failed = [f"{name} {what}: {verdict}" for name, what, verdict in results if verdict]
    assert not failed, "\n".join(failed)
