"""`moetrain eval --run-dir RUN [--step N] | --hf DIR --tasks T1,T2 [--limit N]`: lm-evaluation-harness on moetrain.

Loads a run's checkpoint (the newest complete one, or `--step`; the config saved with it) or a
Hugging Face directory (`train.build.load_hf_model`), wraps it as `harness.MoetrainLM` and runs
lm-evaluation-harness's `simple_evaluate` on the tasks: a local JSONL task file
(`evaluate.tasks.read_task`'s formats) becomes a task config here; any other name is an
lm-evaluation-harness task, found among its own or in `--include`'s YAML directory (which may
point its `dataset_path: json` at local files, so everything runs offline). Under torchrun each
rank loads the whole model and lm-evaluation-harness splits the requests over the ranks.

Results: printed on rank 0, and the full lm-evaluation-harness results JSON written to
`RUN/eval/step_<N>.json` with one `{"kind": "lm_eval", "step": N, "task/<task>/<metric>": ...}`
record appended to the run's metrics.jsonl (and W&B when the run logs there); `--out` writes
the JSON elsewhere (the only output for `--hf`, which never writes into the model directory).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import torch
import tyro

from moetrain.args import check_output_path, parse_typed_args
from moetrain.checkpoint.state import stored_config
from moetrain.commands.export_hf import checkpoint_ref
from moetrain.config.parallel import ParallelConfig
from moetrain.data.tokenizer import build_tokenizer
from moetrain.durable import write_json_atomically
from moetrain.errors import ConfigError
from moetrain.evaluate.harness import harness_model, import_lm_eval, task_config
from moetrain.evaluate.tasks import read_task
from moetrain.logging import get_logger
from moetrain.observe.metrics import MetricsWriter
from moetrain.parallel.process_group import init_distributed, owned_process_group
from moetrain.runtime.run_dir import RunDir
from moetrain.train.build import load_hf_model, model_of_run

log = get_logger("eval")


@dataclass
class EvalOptions:
    """Evaluate a run's checkpoint or a Hugging Face directory with lm-evaluation-harness (extra `eval`)."""

    tasks: str
    """Comma-separated tasks: local JSONL task files (multiple-choice or perplexity lines) and/or
    lm-evaluation-harness task names."""
    run_dir: Annotated[str | None, tyro.conf.arg(aliases=("--run",))] = None
    """Run directory of a training job (its logging.run_dir); exclusive with --hf. Under torchrun spell it
    --run-dir: torchrun takes --run for its own --run-path."""
    step: int | None = None
    """The run's checkpoint step; None = the newest complete checkpoint."""
    hf: str | None = None
    """A Hugging Face model directory (a family moetrain imports); exclusive with --run."""
    limit: int | None = None
    """Documents per task at most (the first N); None = all."""
    batch_size: int = 8
    """Sequences per forward."""
    max_length: int | None = None
    """Tokens of context at most; None = the model's max_seq_len."""
    max_gen_toks: int = 256
    """generate_until tasks: new tokens at most when the task does not say."""
    num_fewshot: int | None = None
    """Few-shot examples per prompt; None = each task's own setting."""
    include: str | None = None
    """A directory of lm-evaluation-harness task YAML files to add to its registry."""
    out: str | None = None
    """Results JSON path; default RUN/eval/step_<N>.json for --run (required to keep results of --hf)."""
    seed: int = 0
    """Seed of sampled generations and of lm-evaluation-harness's few-shot choice."""


def summary(results: dict[str, Any]) -> dict[str, float]:
    """{"task/<task>/<metric>": value} of lm-evaluation-harness's results (filter suffix and stderr dropped)."""
    out = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            metric = key.split(",")[0]
            if metric.endswith("_stderr") or metric == "alias" or not isinstance(value, int | float):
                continue
            out[f"task/{task}/{metric}"] = float(value)
    return out


def resolve_tasks(names: str) -> list[str | dict]:
    tasks: list[str | dict] = []
    for name in (n.strip() for n in names.split(",")):
        if not name:
            continue
        if name.endswith(".jsonl") or Path(name).is_file():
            tasks.append(task_config(read_task(name, field="--tasks")))
        else:
            tasks.append(name)
    if not tasks:
        raise ConfigError(f"--tasks = {names!r} is invalid: name at least one task file or task")
    return tasks


def _load(args: EvalOptions, device: torch.device):
    """(model, tokenizer, JobConfig, step or None) of --run or --hf."""
    if (args.run_dir is None) == (args.hf is None):
        raise ConfigError("give exactly one of --run-dir RUN and --hf DIR")
    if args.hf is not None:
        if not (Path(args.hf) / "config.json").is_file():
            raise ConfigError(f"--hf {args.hf!r} is not a Hugging Face model directory (no config.json)")
        model, cfg = load_hf_model(args.hf, device=device)
        return model, build_tokenizer(cfg.data.tokenizer), cfg, None
    run_dir = RunDir(Path(args.run_dir))
    run_cfg = run_dir.load_config()
    ref = checkpoint_ref(run_dir, args.step, args.run_dir)
    cfg = stored_config(ref) or run_cfg
    model = model_of_run(cfg, ref, device=device)
    return model, build_tokenizer(cfg.data.tokenizer), cfg, ref.step


# What the Hub's clients raise when a dataset is neither cached nor reachable (offline, no network, not found).
_NETWORK_ERRORS = {"OfflineModeIsEnabled", "LocalEntryNotFoundError", "DatasetNotFoundError", "HfHubHTTPError"}


def _needs_network(err: BaseException) -> bool:
    """Whether `err` (or what caused it) says a task's data had to be downloaded and could not be."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, (ConnectionError, TimeoutError)) or type(seen).__name__ in _NETWORK_ERRORS:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def evaluate(args: EvalOptions) -> dict[str, Any] | None:
    """Run the evaluation; lm-evaluation-harness's results on rank 0 (None elsewhere)."""
    lm_eval = import_lm_eval()
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import handle_non_serializable

    check_options(args)
    tasks = resolve_tasks(args.tasks)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        rank, _, device = init_distributed(ParallelConfig())
    else:
        rank, device = 0, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer, cfg, step = _load(args, device)
    lm = harness_model(model, tokenizer, batch_size=args.batch_size, device=device,
                       max_length=args.max_length or cfg.model.max_seq_len, max_gen_toks=args.max_gen_toks,
                       seed=args.seed)
    try:
        results = lm_eval.simple_evaluate(model=lm, tasks=tasks, limit=args.limit, num_fewshot=args.num_fewshot,
                                          task_manager=TaskManager(include_path=args.include), bootstrap_iters=0,
                                          random_seed=args.seed, numpy_random_seed=args.seed,
                                          torch_random_seed=args.seed, fewshot_random_seed=args.seed)
    except Exception as err:  # noqa: BLE001 - the Hub's errors come from datasets, huggingface_hub, requests
        if not _needs_network(err):
            raise
        raise ConfigError(f"--tasks {','.join(tasks)}: a task's data could not be fetched "
                          f"({str(err).splitlines()[0] if str(err) else type(err).__name__}); lm-evaluation-harness "
                          "downloads it from the Hugging Face Hub: run once with network access (it is then cached), "
                          "or give a task YAML reading local files (--include DIR)") from None
    if rank != 0 or results is None:
        return None
    scores = summary(results)
    results = json.loads(json.dumps(results, default=handle_non_serializable))
    source = f"{args.run_dir} step {step}" if args.run_dir else args.hf
    print(f"# lm-evaluation-harness on {source}")
    for key, value in scores.items():
        print(f"{key}: {value:.6g}")
    out = Path(args.out) if args.out else (RunDir(Path(args.run_dir)).root / "eval" / f"step_{step:08d}.json"
                                           if args.run_dir else None)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomically(out, results)
        print(f"wrote {out}")
    if args.run_dir:
        writer = MetricsWriter(args.run_dir, enabled=True, wandb_config=cfg.to_dict() if cfg.logging.wandb else None,
                               wandb_project=cfg.logging.wandb_project)
        writer.write({"kind": "lm_eval", "step": step, **scores})
        writer.close()
    return results


def check_options(args: EvalOptions) -> EvalOptions:
    """One line for the first invalid option, before lm-evaluation-harness or a model is loaded."""
    at_least = {"batch_size": 1, "limit": 1, "max_length": 1, "max_gen_toks": 1, "step": 0, "num_fewshot": 0,
                "seed": 0}  # numpy's generators, which lm-evaluation-harness seeds, take seeds >= 0
    for name, low in at_least.items():
        value = getattr(args, name)
        if value is not None and value < low:
            raise ConfigError(f"--{name.replace('_', '-')} = {value} is invalid: must be >= {low}")
    if args.include is not None and not (Path(args.include).is_dir() and any(Path(args.include).rglob("*.yaml"))):
        raise ConfigError(f"--include {args.include!r} is not a directory of task YAML files")
    if args.out is not None:
        check_output_path(args.out, "--out")
    return args


def main(argv: list[str]) -> int:
    args = check_options(parse_typed_args(EvalOptions, argv, "moetrain eval"))
    with owned_process_group():
        evaluate(args)
    return 0
