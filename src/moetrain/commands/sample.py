"""`moetrain sample --run-dir RUN [--prompt P]`: a continuation of a prompt from a run's newest intact checkpoint.

Loads the newest intact checkpoint's model weights (verified against its manifest, skipping a damaged
newer one with a warning) in one process, built from the config saved with that checkpoint, and
prints a continuation of the prompt (`moetrain.evaluate.generate`). `--speculative mtp` decodes greedily
with the model's multi-token-prediction modules drafting, then once more plainly, and reports the share of
drafts accepted, the speed-up and whether the tokens agree. Generation stops at the tokenizer's
EOS, at the EOS ids of the tokenizer directory's generation_config.json and, with a chat template, at its
end-of-turn tokens. `--chat` renders the prompt as one user message with the run's chat template (the
generation prompt after it) and prints the assistant's reply. It parses and checks the options and
prints; it generates nothing itself and changes neither the model nor the checkpoint.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import tyro

from moetrain.args import parse_typed_args
from moetrain.checkpoint.manifest import newest_intact
from moetrain.checkpoint.state import stored_config
from moetrain.config.job import JobConfig
from moetrain.data.chat import ChatTemplate, ConversationError, end_of_turn_ids, load_chat_template, read_json_object
from moetrain.data.tokenizer import HFTokenizer, Tokenizer, build_tokenizer, tokenizer_file
from moetrain.errors import ConfigError
from moetrain.evaluate.generate import generate_tokens, mtp_speculative_greedy
from moetrain.logging import get_logger
from moetrain.runtime.run_dir import RunDir
from moetrain.train.build import model_of_run

log = get_logger("sample")


@dataclass
class SampleOptions:
    """Generate text from a run's newest complete checkpoint."""

    run_dir: Annotated[str, tyro.conf.arg(aliases=("--run",))]
    """Run directory of a training job (its logging.run_dir). Under torchrun spell it --run-dir: torchrun
    takes --run for an abbreviation of its own --run-path."""
    prompt: str = "def "  # text to continue
    max_tokens: int = 200  # tokens to generate at most
    temperature: float = 0.0  # 0 = greedy, else sampling
    top_p: float = 1.0  # nucleus sampling mass in (0, 1]
    top_k: int = 0  # sample among the k most likely tokens only (0 = all)
    seed: int = 0  # sampling seed
    speculative: Literal["none", "mtp"] = "none"  # mtp: greedy, drafted by the model's MTP modules (model.mtp_depth)
    chat: bool = False  # render the prompt as a user message with the run's chat template; print the reply


def _chat_template(cfg: JobConfig, tokenizer: Tokenizer) -> ChatTemplate | None:
    """The run's chat template (None: the byte tokenizer, or a directory without one)."""
    if not isinstance(tokenizer, HFTokenizer):
        return None
    try:
        return load_chat_template(str(Path(cfg.data.tokenizer)), cfg.data.chat_template)
    except ConfigError:
        return None


def stop_ids(cfg: JobConfig, tokenizer: Tokenizer, template: ChatTemplate | None) -> set[int]:
    """Where generation ends: EOS, generation_config.json's EOS ids, the template's end-of-turn tokens."""
    ids = {tokenizer.eos_id}
    path = tokenizer_file(cfg.data.tokenizer)
    generation = path.parent / "generation_config.json" if path is not None else None
    if generation is not None and generation.is_file():
        eos: Any = read_json_object(generation).get("eos_token_id")
        ids.update(i for i in (eos if isinstance(eos, list) else [eos]) if isinstance(i, int) and i >= 0)
    if template is not None and isinstance(tokenizer, HFTokenizer):
        try:
            ids.update(end_of_turn_ids(template, tokenizer.encode_with_offsets, tokenizer.special_token_ids()))
        except ConversationError:
            pass  # a template that cannot render a one-exchange chat: the other ids stop generation
    return ids


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
    if args.top_k < 0:
        raise ConfigError(f"--top-k = {args.top_k} is invalid: must be >= 0 (0 = no top-k cut)")
    if args.speculative == "mtp" and args.temperature != 0:
        raise ConfigError(f"--speculative mtp is greedy: --temperature = {args.temperature} must be 0")
    run_dir = RunDir(Path(args.run_dir))
    run_cfg = run_dir.load_config()  # also says when --run-dir is not a training run's directory
    ref, skipped = newest_intact(run_dir.checkpoints)
    if ref is None:
        why = f": {skipped[0]}" if skipped else ""
        raise ConfigError(f"--run-dir {args.run_dir!r} has no intact checkpoint under "
                          f"{args.run_dir}/checkpoints{why}")
    for problem in skipped:
        log.warning("skipping a damaged checkpoint: %s; sampling from %s", problem, ref.path.name)
    cfg = stored_config(ref) or run_cfg  # the config the weights were trained with
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    model = model_of_run(cfg, ref)  # the weights: the checkpoint's (a LoRA run's on its base)
    if args.speculative == "mtp":
        if cfg.model.mtp_depth < 1:
            raise ConfigError(f"--speculative mtp needs multi-token-prediction modules: the run at {args.run_dir} has "
                              "model.mtp_depth = 0")
        text, report = speculative_report(model, tokenizer, args.prompt, args.max_tokens)
        print(f"# {args.run_dir} step {ref.step}, greedy, speculative mtp (depth {cfg.model.mtp_depth}): {report}")
        print(args.prompt + text)
        return 0
    template = _chat_template(cfg, tokenizer)
    if args.chat and template is None:
        raise ConfigError(f"--chat needs a chat template, but the run's data.tokenizer = {cfg.data.tokenizer!r} "
                          "has none (and data.chat_template is unset)")
    if args.chat:
        shown, _ = template.render([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
        context = tokenizer.encode(shown).tolist()  # the template frames the conversation: no BOS added
    else:
        shown, context = args.prompt, [tokenizer.bos_id, *tokenizer.encode(args.prompt).tolist()]
    stops = stop_ids(cfg, tokenizer, template)
    new = generate_tokens(model, [context], args.max_tokens, eos_id=tokenizer.eos_id, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.seed, max_context=cfg.data.seq_len,
                          stop=[lambda tokens: tokens[-1] in stops])[0]
    stopped = bool(new) and new[-1] in stops
    how = "greedy" if args.temperature == 0 else f"T={args.temperature} top-p={args.top_p}"
    print(f"# {args.run_dir} step {ref.step}, {how}{', chat' if args.chat else ''}; {len(new)} new token(s)"
          f"{', stopped at an end token' if stopped else ''}")
    print(shown + tokenizer.decode(new[:-1] if stopped else new))
    return 0


def speculative_report(model, tokenizer, prompt: str, max_tokens: int) -> tuple[str, str]:
    """(the speculative continuation, one line: drafts accepted, speed-up over plain greedy, tokens identical)."""
    context = [tokenizer.bos_id, *tokenizer.encode(prompt).tolist()]
    start = time.perf_counter()
    tokens, stats = mtp_speculative_greedy(model, context, max_tokens, eos_id=tokenizer.eos_id)
    speculative_s = time.perf_counter() - start
    start = time.perf_counter()
    plain = generate_tokens(model, [context], max_tokens, eos_id=tokenizer.eos_id)[0]
    plain_s = time.perf_counter() - start
    report = (f"{stats.accepted} of {stats.proposed} drafts accepted ({100 * stats.acceptance_rate:.1f}%), "
              f"{len(tokens)} tokens in {stats.verify_forwards} verifying forwards, "
              f"{plain_s / max(speculative_s, 1e-9):.2f}x the speed of plain greedy ({speculative_s:.3f} s vs "
              f"{plain_s:.3f} s), tokens {'identical' if tokens == plain else 'DIFFERENT'}")
    return tokenizer.decode(tokens), report
