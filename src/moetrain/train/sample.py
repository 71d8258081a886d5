"""Text generation from a trained model: greedy or temperature + nucleus (top-p) sampling.

`generate` works on a plain or an FSDP-sharded model; with several ranks every rank
must call it (each forward gathers parameters) and rank 0's choice of each token is
broadcast so all ranks extend the same text. `main` is `moetrain sample`: it loads the
newest intact checkpoint's model weights (verified against its manifest, skipping a damaged
newer one with a warning) in one process, built from the config saved with that checkpoint,
and prints a continuation of the prompt.
There is no KV cache: each new token reruns the (short) context, which is fine for
the small models this is meant for. Nothing here changes the model or checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from moetrain.args import parse_typed_args
from moetrain.data.tokenizer import Tokenizer, build_tokenizer
from moetrain.errors import ConfigError
from moetrain.logging import get_logger
from moetrain.parallel.collectives import rank_and_world
from moetrain.runtime.run_dir import RunDir
from moetrain.train.build import build_model
from moetrain.train.checkpoint import load_model_weights, newest_intact, stored_config

log = get_logger("sample")


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero all but the smallest set of most likely tokens whose mass reaches top_p; renormalise.

    probs: [V] summing to 1. The most likely token is always kept.
    """
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(descending=True)
    mass_before = sorted_probs.cumsum(0) - sorted_probs
    keep_sorted = mass_before < top_p
    keep_sorted[0] = True
    kept = torch.zeros_like(probs)
    kept[order[keep_sorted]] = probs[order[keep_sorted]]
    return kept / kept.sum()


def next_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """Choose a token from last-position logits [V]: argmax when temperature == 0."""
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    probs = top_p_filter(probs, top_p)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(model: nn.Module, tokenizer: Tokenizer, prompt: str, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, device: torch.device | str = "cpu", max_context: int = 512) -> str:
    """Continue `prompt` (as a fresh document: BOS first) until EOS or max_new_tokens."""
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    context = [tokenizer.bos_id, *tokenizer.encode(prompt).tolist()]
    new_tokens: list[int] = []
    broadcast = rank_and_world()[1] > 1
    try:
        for _ in range(max_new_tokens):
            window = torch.tensor([context[-max_context:]], dtype=torch.long, device=device)
            logits = model(window)[0, -1].float().cpu()
            token = next_token(logits, temperature, top_p, generator)
            if broadcast:
                chosen = torch.tensor([token], dtype=torch.long, device=device)
                dist.broadcast(chosen, src=0)
                token = int(chosen.item())
            if token == tokenizer.eos_id:
                break
            context.append(token)
            new_tokens.append(token)
    finally:
        model.train(was_training)
    return tokenizer.decode(new_tokens)


@dataclass
class SampleOptions:
    """Generate text from a run's newest complete checkpoint."""

    run: str  # run directory of a training job (its logging.run_dir)
    prompt: str = "def "  # text to continue
    max_tokens: int = 200  # tokens to generate at most
    temperature: float = 0.0  # 0 = greedy, else sampling
    top_p: float = 1.0  # nucleus sampling mass in (0, 1]
    seed: int = 0  # sampling seed


def main(argv: list[str]) -> int:
    args = parse_typed_args(SampleOptions, argv, "moetrain sample", bool_flags=True)
    if args.max_tokens < 1:
        raise ConfigError(f"--max-tokens = {args.max_tokens} is invalid: must be >= 1")
    if not 0 <= args.temperature < float("inf"):  # also nan
        raise ConfigError(f"--temperature = {args.temperature} is invalid: must be a finite number >= 0 (0 = greedy)")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError("--prompt is not valid UTF-8 text (it holds bytes the shell could not decode)") from None
    if not 0 < args.top_p <= 1:
        raise ConfigError(f"--top-p = {args.top_p} is invalid: must be in (0, 1]")
    run_dir = RunDir(Path(args.run))
    run_cfg = run_dir.load_config()  # also says when --run is not a training run's directory
    ref, skipped = newest_intact(run_dir.checkpoints)
    if ref is None:
        why = f": {skipped[0]}" if skipped else ""
        raise ConfigError(f"--run {args.run!r} has no intact checkpoint under {args.run}/checkpoints{why}")
    for problem in skipped:
        log.warning("skipping a damaged checkpoint: %s; sampling from %s", problem, ref.path.name)
    cfg = stored_config(ref) or run_cfg  # the config the weights were trained with
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    model = build_model(cfg.model, weights="none")  # the weights: the checkpoint's
    load_model_weights(ref, model)
    text = generate(model, tokenizer, args.prompt, args.max_tokens, args.temperature, args.top_p, args.seed,
                    max_context=cfg.data.seq_len)
    how = "greedy" if args.temperature == 0 else f"T={args.temperature} top-p={args.top_p}"
    print(f"# {args.run} step {ref.step}, {how}")
    print(args.prompt + text)
    return 0
