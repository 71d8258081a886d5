"""A moetrain model as an lm-evaluation-harness `LM`, and local task files as lm-evaluation-harness tasks.

`harness_model(model, tokenizer, ...)` returns an instance of `MoetrainLM`, a `TemplateLM` subclass
built (and registered under the name "moetrain") the first time it is asked for, so importing this
module never needs `lm_eval`:

- `loglikelihood`: (context, continuation) pairs tokenised by `tasks.encode_pair` (lm-evaluation-
  harness's rules, BOS first: moetrain's documents start with it) and scored by
  `tasks.score_continuations`, batched.
- `loglikelihood_rolling`: the text (no BOS) cut into lm-evaluation-harness's disjoint rolling
  windows of `max_length` tokens with BOS as the prefix token, the windows scored in batches.
- `generate_until`: `generate.generate_tokens` with the KV cache, batched per generation
  setting; stops at EOS, at any `until` string (the text is cut before it) or after `max_gen_toks`.

Under torchrun every rank holds the whole model and lm-evaluation-harness hands each rank its share
of the requests (`rank`, `world_size`, `all_gather`, `gather_object` use torch.distributed); the
model's forwards need no collective. `task_config(task)` is the lm-evaluation-harness config of a
local task file (`tasks.read_task`): multiple choice with `acc` and `acc_norm`, or rolling
log-likelihood with word/byte perplexity and bits per byte.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moetrain.data.tokenizer import Tokenizer
from moetrain.errors import ConfigError
from moetrain.evaluate.generate import generate_tokens, stop_at_strings
from moetrain.evaluate.tasks import (
    TARGET_DELIMITER,
    LocalTask,
    encode_pair,
    score_continuations,
    tokenizer_encoder,
)

MODEL_NAME = "moetrain"  # the name the class is registered under in lm-evaluation-harness


def import_lm_eval():
    try:
        import lm_eval  # the optional extra
    except ImportError:
        raise ConfigError("moetrain eval needs lm-evaluation-harness, which is not installed; install the extra "
                          "`pip install moetrain[eval]` (lm_eval>=0.4)") from None
    return lm_eval


def task_config(task: LocalTask) -> dict[str, Any]:
    """lm-evaluation-harness's task config (as its YAML would give it) for a local JSONL task file."""
    base = {"task": task.name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(task.path)}},
            "test_split": "test", "metadata": {"version": 1.0}}
    if task.kind == "multiple_choice":
        return {**base, "output_type": "multiple_choice", "doc_to_text": "{{query}}", "doc_to_choice": "{{choices}}",
                "doc_to_target": "{{gold}}", "target_delimiter": TARGET_DELIMITER,
                "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                                {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}]}
    return {**base, "output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
            "metric_list": [{"metric": "word_perplexity"}, {"metric": "byte_perplexity"},
                            {"metric": "bits_per_byte"}]}


def _gen_settings(kwargs: dict[str, Any], default_max: int) -> tuple[list[str], dict[str, Any]]:
    """(stop strings, generate_tokens keyword arguments) from lm-evaluation-harness's gen_kwargs."""
    kwargs = dict(kwargs)
    until = kwargs.pop("until", None) or []
    until = [until] if isinstance(until, str) else list(until)
    do_sample = kwargs.pop("do_sample", None)
    temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
    # As the hf backend hands them to `generate`: do_sample=False is greedy whatever the temperature;
    # otherwise a positive temperature samples (and temperature 0 is greedy).
    settings = {"max_new_tokens": int(kwargs.pop("max_gen_toks", default_max)),
                "temperature": 0.0 if do_sample is False else temperature,
                "top_p": float(kwargs.pop("top_p", 1.0) or 1.0), "top_k": int(kwargs.pop("top_k", 0) or 0)}
    return until, settings


class MoetrainLMMethods:
    """The methods of MoetrainLM, lm-evaluation-harness's view of a moetrain model (see the module docstring).

    A plain class, so defining it needs no `lm_eval`; `model_class` puts `TemplateLM` behind it.
    """

    def __init__(self, model: nn.Module, tokenizer: Tokenizer, batch_size: int = 8, max_length: int = 2048,
                 device: torch.device | str = "cpu", max_gen_toks: int = 256, seed: int = 0):
        super().__init__()
        self.model, self.tokenizer = model.eval(), tokenizer
        self._batch_size, self._max_length, self._max_gen_toks = batch_size, max_length, max_gen_toks
        self._device, self.seed = torch.device(device), seed
        self._encode = tokenizer_encoder(tokenizer)
        self._rank, self._world_size = (dist.get_rank(), dist.get_world_size()) if (
            dist.is_available() and dist.is_initialized()) else (0, 1)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer.bos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return "moetrain"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        ids = self._encode(string)
        return [self.tokenizer.bos_id, *ids] if add_special_tokens is None or add_special_tokens else ids

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(list(tokens))

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [encode_pair(self._encode, self.tokenizer.bos_id, *req.args) for req in requests]
        return self._loglikelihood_tokens(pairs)

    def _loglikelihood_tokens(self, requests, **kwargs) -> list[tuple[float, bool]]:
        pairs = [(r[-2], r[-1]) for r in requests]  # lm-eval passes ((context, cont), ctx_ids, cont_ids)
        return score_continuations(self.model, pairs, self._batch_size, self._device, self._max_length)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval import utils  # the optional extra, present once model_class() has run

        windows, owner = [], []
        for index, req in enumerate(requests):
            tokens = self._encode(req.args[0])
            for window in utils.get_rolling_token_windows(token_list=tokens, prefix_token=self.prefix_token_id,
                                                          max_seq_len=self._max_length, context_len=1):
                windows.append(utils.make_disjoint_window(window))
                owner.append(index)
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(owner, score_continuations(
                self.model, windows, self._batch_size, self._device, self._max_length), strict=True):
            totals[index] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for index, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(index)
        for indices in groups.values():
            until, settings = _gen_settings(requests[indices[0]].args[1], self._max_gen_toks)
            room = max(self._max_length - settings["max_new_tokens"], 1)
            for start in range(0, len(indices), self._batch_size):
                chunk = indices[start:start + self._batch_size]
                prompts = [self.tok_encode(requests[i].args[0])[-room:] for i in chunk]
                stops = [stop_at_strings(self.tok_decode, until)] * len(chunk)
                new = generate_tokens(self.model, prompts, eos_id=self.eot_token_id, seed=self.seed,
                                      device=self._device, max_context=self._max_length, stop=stops,
                                      sync_ranks=False, **settings)
                for i, tokens in zip(chunk, new, strict=True):
                    text = self.tok_decode(tokens)
                    for term in until:
                        if term:
                            text = text.split(term)[0]
                    results[i] = text
        return results  # type: ignore[return-value]

    # torch.distributed for lm-evaluation-harness's split of the requests over ranks
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._world_size == 1:
            return tensor
        parts = [torch.zeros_like(tensor) for _ in range(self._world_size)]
        dist.all_gather(parts, tensor)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj, dst: int = 0):
        if self._world_size == 1:
            return [obj]
        out = [None] * self._world_size if self._rank == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def barrier(self) -> None:
        if self._world_size > 1:
            dist.barrier()


@lru_cache(maxsize=1)
def model_class() -> type:
    """MoetrainLM, defined and registered with lm-evaluation-harness on first use."""
    import_lm_eval()
    import lm_eval.models  # noqa: F401  # its built-in models first: the registry loads them only while empty
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model

    class MoetrainLM(MoetrainLMMethods, TemplateLM):
        """lm-evaluation-harness's view of a moetrain model (see the module docstring)."""

    return register_model(MODEL_NAME)(MoetrainLM)


def harness_model(model: nn.Module, tokenizer: Tokenizer, **kwargs):
    """An lm-evaluation-harness LM running `model` (see MoetrainLM's arguments)."""
    return model_class()(model, tokenizer, **kwargs)
