"""Text generation from a trained model: greedy or temperature + top-k + nucleus (top-p) sampling, batched.

`generate_tokens` continues a batch of token prompts of any lengths. By default it keeps a KV cache
(`model.kv_cache`): the prompts run once, left-padded into one batch, then each step feeds one token
per unfinished row. `use_cache=False` is the re-running path (every token reruns its row's whole
context, one row at a time), kept as the reference the cache is tested against token for token and
for the speed benchmark; once a row's context outgrows `max_context` both paths rerun the last
`max_context` tokens, so they agree there too. A row stops at EOS, when its `stop` callback says so
(stop strings), or after `max_new_tokens`.

Generation works on a plain or an FSDP-sharded model; with several ranks every rank must call it
(each forward gathers parameters) and rank 0's choice of each token is broadcast so all ranks extend
the same text and finish the same rows. `mtp_speculative_greedy` is greedy decoding drafted by the
model's multi-token-prediction modules (self-speculative, one process). Training's final sample,
`moetrain sample` and lm-evaluation-harness's `generate_until` all generate here. It neither loads
checkpoints nor parses command lines, and it never changes the model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from moetrain.data.tokenizer import Tokenizer
from moetrain.errors import ConfigError
from moetrain.logging import get_logger
from moetrain.model.kv_cache import KVCache, accepts_cache
from moetrain.parallel.collectives import rank_and_world

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


def top_k_filter(probs: torch.Tensor, top_k: int) -> torch.Tensor:
    """Zero all but the top_k most likely tokens of probs [V] and renormalise (top_k <= 0: keep all)."""
    if top_k <= 0 or top_k >= probs.numel():
        return probs
    kept = torch.zeros_like(probs)
    best = probs.topk(top_k).indices
    kept[best] = probs[best]
    return kept / kept.sum()


def next_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator,
               top_k: int = 0) -> int:
    """Choose a token from last-position logits [V]: argmax when temperature == 0, else top-k then top-p."""
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    probs = top_p_filter(top_k_filter(probs, top_k), top_p)
    return int(torch.multinomial(probs, 1, generator=generator))


def stop_at_strings(decode: Callable[[list[int]], str], strings: Sequence[str]) -> Callable[[list[int]], bool]:
    """A `stop` callback for `generate_tokens`: True once the decoded new tokens contain one of `strings`."""
    strings = [s for s in strings if s]
    return lambda new_tokens: bool(strings) and any(s in decode(new_tokens) for s in strings)


def _left_padded(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as one [B, max_len] batch, each row right-aligned; returns (tokens, pad lengths [B])."""
    longest = max(len(p) for p in prompts)
    pad_B = torch.tensor([longest - len(p) for p in prompts], dtype=torch.long)
    # Padding slots repeat the row's first token: any id is exact (no real query attends to them).
    rows = [[p[0]] * (longest - len(p)) + list(p) for p in prompts]
    return torch.tensor(rows, dtype=torch.long, device=device), pad_B.to(device)


@torch.no_grad()
def generate_tokens(model: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                    eos_id: int | None = None, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                    seed: int = 0, device: torch.device | str = "cpu", max_context: int | None = None,
                    stop: Sequence[Callable[[list[int]], bool] | None] | None = None,
                    use_cache: bool = True, sync_ranks: bool | None = None) -> list[list[int]]:
    """The new tokens of each prompt (EOS not included), generated together.

    `stop[b]`, when given, is asked after each new token of row b whether the row is done.
    Sampling draws one generator in row order at every step, so both paths sample alike.
    `sync_ranks` (default: whether several ranks run) broadcasts rank 0's tokens, for a sharded
    model all ranks generate alike; False when each rank runs its own prompts on a whole model.
    """
    prompts = [list(p) for p in prompts]
    if not prompts:
        return []
    if any(not p for p in prompts):
        raise ConfigError("generation needs a non-empty prompt for every row (start each with BOS)")
    batch = len(prompts)
    max_context = max_context or max(len(p) for p in prompts) + max_new_tokens
    stop = list(stop) if stop is not None else [None] * batch
    was_training = model.training
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    broadcast = rank_and_world()[1] > 1 if sync_ranks is None else sync_ranks
    new_tokens: list[list[int]] = [[] for _ in range(batch)]
    active = list(range(batch))  # rows still generating, in order
    longest = max(len(p) for p in prompts)
    cache = None
    logits_BV = None
    try:
        if use_cache and not all(accepts_cache(layer.attention) for layer in model.layers):
            log.info("an attention module takes no KV cache: generation reruns the context for every token")
            use_cache = False
        sharded = any(isinstance(p, DTensor) for p in model.parameters())
        # A cached generation on a whole model runs in inference mode: no autograd bookkeeping on any op,
        # much of a decode step's cost besides its GEMVs. The rerun path (use_cache=False) and a sharded
        # model (whose parameter gathers must stay ordinary tensors) run under no_grad only, as before.
        with torch.inference_mode(use_cache and not sharded):
            if use_cache and longest <= max_context and max_new_tokens > 0:
                tokens_BS, pad_B = _left_padded(prompts, device)
                cache = KVCache(len(model.layers), batch, longest + max_new_tokens, pad=pad_B, device=device,
                                copy_weights=not sharded)  # no copies of a sharded model's full weights
                logits_BV = model(tokens_BS, cache=cache)[:, -1].float()
            for step in range(max_new_tokens):
                if cache is None or longest + step > max_context:  # re-run each row's (windowed) context
                    cache = None
                    logits_BV = torch.cat([model(torch.tensor([(prompts[b] + new_tokens[b])[-max_context:]],
                                                              dtype=torch.long, device=device))[:, -1].float()
                                           for b in active])
                if temperature == 0:  # greedy: every row's argmax (next_token's choice) in one call
                    chosen = logits_BV.argmax(dim=-1).tolist()
                else:
                    chosen = [next_token(row, temperature, top_p, generator, top_k) for row in logits_BV.cpu()]
                if broadcast:
                    chosen_B = torch.tensor(chosen, dtype=torch.long, device=device)
                    dist.broadcast(chosen_B, src=0)
                    chosen = chosen_B.tolist()
                still = []
                for i, (b, token) in enumerate(zip(active, chosen, strict=True)):
                    if token == eos_id:
                        continue
                    new_tokens[b].append(token)
                    if stop[b] is not None and stop[b](new_tokens[b]):
                        continue
                    still.append(i)
                active = [active[i] for i in still]
                if not active or step + 1 == max_new_tokens:
                    break
                if cache is not None and longest + step + 1 <= max_context:
                    if len(still) < len(chosen):  # finished rows leave the batch
                        cache.keep_rows(torch.tensor(still, dtype=torch.long, device=device))
                    next_B1 = torch.tensor([[chosen[i]] for i in still], dtype=torch.long, device=device)
                    logits_BV = model(next_B1, cache=cache)[:, -1].float()
    finally:
        model.train(was_training)
    return new_tokens


@dataclass
class SpeculationStats:
    """What self-speculative decoding measured: drafts proposed and accepted, and the main model's forwards."""

    proposed: int = 0
    accepted: int = 0
    verify_forwards: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(self.proposed, 1)


@torch.no_grad()
def mtp_speculative_greedy(model: nn.Module, prompt: Sequence[int], max_new_tokens: int, *,
                           eos_id: int | None = None, device: torch.device | str = "cpu"
                           ) -> tuple[list[int], SpeculationStats]:
    """Greedy continuation of one prompt, drafted by the model's MTP modules and verified by the main model.

    Each round MTP depth k drafts token T + k from the hidden states so far; one main forward over the
    newest token and the D drafts gives the greedy token at every one of those positions; the drafts are
    kept up to the first that greedy would not have chosen, followed by greedy's own token there. Every
    emitted token is the main model's greedy choice, so the tokens are those of plain greedy decoding (up to
    floating-point differences between a forward of D + 1 tokens and D + 1 forwards of one, which could only
    flip an exact tie). The KV caches (main, and one per depth) are rewound past rejected drafts; depth k
    keeps position j only once token j + k is committed. A whole (unsharded) model in one process.
    """
    depth, n_layers = model.cfg.mtp_depth, len(model.layers)
    if depth < 1:
        raise ConfigError("--speculative mtp needs a model with multi-token-prediction modules (model.mtp_depth >= 1)")
    was_training = model.training
    model.eval()
    stats, new = SpeculationStats(), []
    capacity = len(prompt) + max_new_tokens + depth + 2
    main_cache = KVCache(n_layers + depth, 1, capacity, device=device)
    depth_caches = [KVCache(n_layers + depth, 1, capacity, device=device) for _ in range(depth)]
    tokens = list(prompt)
    try:
        with torch.inference_mode():
            logits, hidden = model.cached_forward(torch.tensor([tokens], device=device), main_cache)
            # history[k]: h^k [positions, dim] of the committed positions (as many as depth k's cache holds).
            history = [hidden[0]] + [hidden.new_zeros(0, hidden.shape[-1]) for _ in range(depth)]
            pending = [int(logits[0, -1].argmax())]
            while True:
                for token in pending:
                    if token == eos_id or len(new) == max_new_tokens:
                        return new, stats
                    new.append(token)
                tokens += pending
                if len(new) == max_new_tokens:
                    return new, stats
                drafts, outputs = _draft(model, tokens, history, depth_caches, device)
                pending = _verify(model, tokens, drafts, outputs, history, main_cache, depth_caches, stats, device)
    finally:
        model.train(was_training)


def _draft(model: nn.Module, tokens: list[int], history: list[torch.Tensor], caches: list[KVCache],
           device) -> tuple[list[int], list[torch.Tensor]]:
    """(drafts of tokens T + 1..T + D, each depth's hidden states this round) where T = len(tokens) - 1.

    Depth k runs its positions from its committed length to T - 1, on h^{k-1} there (committed history, then
    this round's outputs of depth k - 1) and the tokens k ahead (committed, then the drafts so far).
    """
    last = len(tokens) - 1
    drafts: list[int] = []
    outputs: list[torch.Tensor] = []
    for k, cache in enumerate(caches, start=1):
        start = cache.length
        previous = history[k - 1] if k == 1 else torch.cat([history[k - 1], outputs[-1]])
        ahead = (tokens + drafts)[start + k:last + k]
        logits, hidden = model.mtp_cached_forward(k, previous[start:last].unsqueeze(0),
                                                  torch.tensor([ahead], device=device), cache)
        drafts.append(int(logits[0, -1].argmax()))
        outputs.append(hidden[0])
    return drafts, outputs


def _verify(model: nn.Module, tokens: list[int], drafts: list[int], outputs: list[torch.Tensor],
            history: list[torch.Tensor], main_cache: KVCache, caches: list[KVCache], stats: SpeculationStats,
            device) -> list[int]:
    """The tokens this round commits after tokens[-1]: the accepted drafts and greedy's next token; caches and
    history are cut back to what those make final."""
    last = len(tokens) - 1
    logits, hidden = model.cached_forward(torch.tensor([[tokens[-1], *drafts]], device=device), main_cache)
    greedy = logits[0].argmax(dim=-1).tolist()
    accepted = 0
    while accepted < len(drafts) and drafts[accepted] == greedy[accepted]:
        accepted += 1
    stats.proposed += len(drafts)
    stats.accepted += accepted
    stats.verify_forwards += 1
    main_cache.rewind(last + accepted + 1)
    history[0] = torch.cat([history[0], hidden[0, :accepted + 1]])
    newest = last + accepted + 1  # the index the next round's last token will have
    for k, (cache, output) in enumerate(zip(caches, outputs, strict=True), start=1):
        committed = min(last, newest - k)  # position j is final once token j + k is
        history[k] = torch.cat([history[k], output])[:committed]
        cache.rewind(committed)
    return [*drafts[:accepted], greedy[accepted]]


def generate(model: nn.Module, tokenizer: Tokenizer, prompt: str, max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, device: torch.device | str = "cpu", max_context: int = 512,
             top_k: int = 0, use_cache: bool = True) -> str:
    """Continue `prompt` (as a fresh document: BOS first) until EOS or max_new_tokens."""
    context = [tokenizer.bos_id, *tokenizer.encode(prompt).tolist()]
    new = generate_tokens(model, [context], max_new_tokens, eos_id=tokenizer.eos_id, temperature=temperature,
                          top_p=top_p, top_k=top_k, seed=seed, device=device, max_context=max_context,
                          use_cache=use_cache)
    return tokenizer.decode(new[0])
