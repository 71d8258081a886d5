"""Downstream tasks from local JSONL files, scored by log-likelihood the way lm-evaluation-harness scores them.

One place for what both the in-loop evaluation (`train.eval_tasks`, every `eval_every` steps) and
the lm-evaluation-harness adapter (`moetrain.evaluate.harness`) compute, so the two agree:

- task files: one JSON object a line. A multiple-choice task's lines are
  `{"query": str, "choices": [str, ...], "gold": int}`; a perplexity task's `{"text": str}`.
- `encode_pair`: lm-evaluation-harness's `TemplateLM` tokenisation of (context, continuation):
  trailing spaces of the context move to the continuation, the pair is encoded whole and the
  context's tokens are cut off the front; the context starts with BOS (moetrain's documents do),
  an empty context is BOS alone.
- `score_continuations`: Σ log p(continuation | context) and whether every continuation token is
  the argmax, batched (right padding: causal attention never lets a real token see it), inputs
  longer than `max_length` + 1 cut from the left as its `hf` backend does.
- `choice_metrics`: `acc` (argmax of the log-likelihoods is the gold choice) and `acc_norm` (argmax
  of log-likelihood / characters of the choice), first index winning ties like `numpy.argmax`.
- `evaluate_choice_tasks`: the in-loop pass, documents split over data-parallel ranks, every rank
  running the same number of forwards (FSDP gathers parameters in each), counts summed over ranks.

It reads files and runs forwards; it does not know lm-evaluation-harness (an optional extra).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moetrain.data.tokenizer import Tokenizer
from moetrain.errors import ConfigError

TARGET_DELIMITER = " "  # lm-evaluation-harness's default between a multiple-choice query and a choice
TASK_KINDS = ("multiple_choice", "perplexity")


@dataclass(frozen=True)
class LocalTask:
    """A task read from a JSONL file: its name (the file's stem), kind (one of TASK_KINDS) and documents."""

    name: str
    path: Path
    kind: str
    docs: list[dict]


def read_task(path: str | Path, field: str = "train.eval_tasks") -> LocalTask:
    """Read and check a task file (see the module docstring for the two line formats)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{field}: task file {str(path)!r} does not exist")
    docs = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{field}: {path}:{number} is not JSON ({err.msg})") from None
        docs.append(_checked(doc, path, number, field))
    if not docs:
        raise ConfigError(f"{field}: task file {str(path)!r} has no documents")
    kinds = {"perplexity" if "text" in doc else "multiple_choice" for doc in docs}
    if len(kinds) > 1:
        raise ConfigError(f"{field}: {path} mixes multiple-choice and perplexity lines; use one kind per file")
    return LocalTask(name=path.stem, path=path.resolve(), kind=kinds.pop(), docs=docs)


def read_choice_tasks(paths: Sequence[str], field: str = "train.eval_tasks") -> list[LocalTask]:
    """The multiple-choice task files of the in-loop evaluation, checked (kind, distinct names)."""
    tasks = [read_task(path, field) for path in paths]
    for task in tasks:
        if task.kind != "multiple_choice":
            raise ConfigError(f"{field}: {task.path} is a {task.kind} task; in-loop tasks are multiple choice "
                              "(score perplexity with moetrain eval)")
    names = [task.name for task in tasks]
    if len(set(names)) != len(names):
        raise ConfigError(f"{field} = {list(paths)!r} is invalid: two files share a name (file stem), which "
                          "names their metrics")
    return tasks


def _checked(doc: object, path: Path, number: int, field: str) -> dict:
    where = f"{field}: {path}:{number}"
    if isinstance(doc, dict) and set(doc) == {"text"} and isinstance(doc["text"], str) and doc["text"]:
        return doc
    if not isinstance(doc, dict) or set(doc) != {"query", "choices", "gold"}:
        raise ConfigError(f"{where} must be {{\"query\": str, \"choices\": [str, ...], \"gold\": int}} "
                          f"or {{\"text\": str}}")
    choices, gold = doc["choices"], doc["gold"]
    if not isinstance(doc["query"], str) or not doc["query"]:
        raise ConfigError(f"{where}: query must be a non-empty string")
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
        raise ConfigError(f"{where}: choices must be a list of at least 2 non-empty strings")
    if not isinstance(gold, int) or isinstance(gold, bool) or not 0 <= gold < len(choices):
        raise ConfigError(f"{where}: gold = {gold!r} is invalid: must be an index into its {len(choices)} choices")
    return doc


def encode_pair(encode: Callable[[str], list[int]], bos_id: int, context: str,
                continuation: str) -> tuple[list[int], list[int]]:
    """(context tokens, continuation tokens) as lm-evaluation-harness's TemplateLM cuts them, BOS first."""
    if not context:
        return [bos_id], encode(continuation)
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = [bos_id, *encode(context + continuation)]
    context_tokens = [bos_id, *encode(context)]
    return context_tokens, whole[len(context_tokens):]


def choice_requests(doc: dict, encode: Callable[[str], list[int]], bos_id: int) -> list[tuple[list[int], list[int]]]:
    """One (context, continuation) token pair per choice of a multiple-choice document."""
    return [encode_pair(encode, bos_id, doc["query"], TARGET_DELIMITER + choice) for choice in doc["choices"]]


def tokenizer_encoder(tokenizer: Tokenizer) -> Callable[[str], list[int]]:
    return lambda text: tokenizer.encode(text).tolist()


@torch.no_grad()
def score_continuations(model: nn.Module, requests: Sequence[tuple[list[int], list[int]]], batch_size: int,
                        device: torch.device | str, max_length: int) -> list[tuple[float, bool]]:
    """(Σ log p(continuation | context), every continuation token greedy) per request, in request order.

    Requests run longest first in batches of `batch_size` (so a batch pads little); the number of
    forwards is ceil(len(requests) / batch_size) whatever the lengths.
    """
    order = sorted(range(len(requests)), key=lambda i: -(len(requests[i][0]) + len(requests[i][1])))
    results: list[tuple[float, bool] | None] = [None] * len(requests)
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        inputs, lengths = [], []
        for i in chunk:
            context, continuation = requests[i]
            if not continuation:
                raise ConfigError("a continuation encodes to no tokens; every choice must be non-empty text")
            tokens = (context + continuation)[-(max_length + 1):][:-1]
            inputs.append(tokens)
            lengths.append(len(tokens))
        width = max(lengths)
        batch = torch.zeros(len(chunk), width, dtype=torch.long)
        for row, tokens in enumerate(inputs):
            batch[row, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        logits = model(batch.to(device))
        logprobs = F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1).cpu()
        for row, i in enumerate(chunk):
            continuation = requests[i][1]
            n = len(continuation)
            picked = logprobs[row, lengths[row] - n:lengths[row]]  # positions predicting the continuation
            target = torch.tensor(continuation, dtype=torch.long)
            total = float(picked.gather(1, target.unsqueeze(1)).sum())
            results[i] = (total, bool((picked.argmax(-1) == target).all()))
    return results  # type: ignore[return-value]


def choice_metrics(loglikelihoods: Sequence[float], choices: Sequence[str], gold: int) -> tuple[float, float]:
    """(acc, acc_norm) of one document, lm-evaluation-harness's definitions."""
    lls = torch.tensor(loglikelihoods, dtype=torch.float64)
    normed = lls / torch.tensor([float(len(c)) for c in choices], dtype=torch.float64)
    # torch.argmax on CPU returns the first maximal index, as numpy.argmax does
    return float(int(lls.argmax()) == gold), float(int(normed.argmax()) == gold)


def evaluate_choice_tasks(model: nn.Module, tokenizer: Tokenizer, tasks: Sequence[LocalTask], batch_size: int,
                          device: torch.device | str, max_length: int, rank: int = 0, world: int = 1,
                          limit: int | None = None) -> dict[str, float]:
    """{"task/<name>/acc": ..., "task/<name>/acc_norm": ...} over every document (first `limit`), all ranks.

    Rank r scores documents r, r + world, ...; a rank with fewer requests than another repeats its
    first one (the result is dropped) so every rank runs the same forwards.
    """
    was_training = model.training
    model.eval()
    encode = tokenizer_encoder(tokenizer)
    out: dict[str, float] = {}
    try:
        for task in tasks:
            docs = task.docs[:limit] if limit else task.docs
            mine = list(range(rank, len(docs), world))
            requests = [r for d in mine for r in choice_requests(docs[d], encode, tokenizer.bos_id)]
            needed = len(requests)
            if world > 1:
                most = torch.tensor([needed], dtype=torch.long, device=device)
                dist.all_reduce(most, op=dist.ReduceOp.MAX)
                filler = choice_requests(docs[0], encode, tokenizer.bos_id)[0]
                requests += [filler] * (int(most.item()) - needed)
            scores = score_continuations(model, requests, batch_size, device, max_length)[:needed]
            sums = torch.zeros(3, dtype=torch.float64)
            cursor = 0
            for d in mine:
                choices = docs[d]["choices"]
                lls = [s for s, _ in scores[cursor:cursor + len(choices)]]
                cursor += len(choices)
                acc, acc_norm = choice_metrics(lls, choices, docs[d]["gold"])
                sums += torch.tensor([acc, acc_norm, 1.0], dtype=torch.float64)
            if world > 1:
                sums = sums.to(device)
                dist.all_reduce(sums)
                sums = sums.cpu()
            out[f"task/{task.name}/acc"] = float(sums[0] / sums[2])
            out[f"task/{task.name}/acc_norm"] = float(sums[1] / sums[2])
    finally:
        model.train(was_training)
    return out
