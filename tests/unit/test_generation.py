"""KV-cache generation (model.kv_cache, evaluate.generate) against the re-running path and direct forwards.

The reference is the model's own full forward on each row alone (no cache, no padding): the cached
logits of every prefix must match it, and greedy generation must be token-identical to re-running
the context for every new token, for dense and MoE models, both RoPE layouts, QK-norm variants, and
prompts of different lengths sharing one left-padded batch.
"""

import pytest
import torch

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.errors import ModelError
from moetrain.evaluate.generate import generate_tokens, next_token, stop_at_strings, top_k_filter
from moetrain.model.kv_cache import KVCache
from moetrain.train.build import build_model

PROMPTS = [[1, 5, 9], [1, 7, 3, 3, 8, 2, 40], [1, 2, 60, 11, 12, 13, 14, 15, 16, 17, 18, 19]]


def model_of(kind: str, dtype=torch.float32, **overrides):
    moe = MoEConfig(n_experts=4, top_k=2, expert_hidden=16, impl="loop")
    base = dict(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=128,
                moe=moe, n_dense_layers=3 if kind == "dense" else 1)
    base.update(overrides)
    model = build_model(ModelConfig(**base), seed=3, init_scheme="gpt2")
    return model.to(dtype).eval()


VARIANTS = {
    "dense": dict(kind="dense"),
    "moe": dict(kind="moe"),
    "moe-qwen3-like": dict(kind="moe", qk_norm="per_head", rope_layout="half"),
    "moe-olmoe-like": dict(kind="moe", qk_norm="full", clip_qkv=0.5, n_kv_heads=4),
    # sinks, a window shorter than the prompts on alternate layers, and every projection biased
    "moe-gpt-oss-like": dict(kind="moe", attention_sinks=True, sliding_window=4, attention_bias="all",
                             layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "moe-glm-like": dict(kind="moe", partial_rotary_factor=0.5, rope_layout="half", attention_bias="qkv"),
    # MLA (DeepSeek-V3 line): value heads narrower than the query/key heads, one full query projection
    "mla": dict(kind="moe", kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6),
    # the low-rank query path, values wider than q/k, YaRN (its softmax factor on q), the DeepSeek-V3 router
    "mla-q-lora-yarn": dict(kind="moe", kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=4, qk_rope_head_dim=4,
                            v_head_dim=10, rope_scaling="yarn", rope_yarn_factor=4.0,
                            rope_yarn_original_max_seq_len=8, rope_yarn_mscale=1.0, rope_yarn_mscale_all_dim=1.0,
                            moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, impl="loop", score_func="sigmoid",
                                          load_balance="aux_free", n_shared_experts=1)),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_logits_equal_the_full_forward_of_each_row(variant):
    opts = dict(VARIANTS[variant])
    model = model_of(opts.pop("kind"), torch.float64, **opts)
    longest = max(len(p) for p in PROMPTS)
    pad = torch.tensor([longest - len(p) for p in PROMPTS])
    tokens = torch.tensor([[p[0]] * (longest - len(p)) + p for p in PROMPTS])
    extra = torch.tensor([[4, 20, 33], [6, 6, 1], [63, 0, 2]])  # three decode steps per row
    cache = KVCache(len(model.layers), len(PROMPTS), longest + 3, pad=pad)
    with torch.no_grad():
        prefill = model(tokens, cache=cache)
        steps = [model(extra[:, i:i + 1], cache=cache)[:, 0] for i in range(3)]
        for b, prompt in enumerate(PROMPTS):
            full = model(torch.tensor([prompt + extra[b].tolist()]))[0]
            torch.testing.assert_close(prefill[b, pad[b]:], full[:len(prompt)], atol=1e-10, rtol=0)
            for i in range(3):
                torch.testing.assert_close(steps[i][b], full[len(prompt) + i], atol=1e-10, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_cached_generation_is_token_identical_to_rerunning(variant):
    opts = dict(VARIANTS[variant])
    model = model_of(opts.pop("kind"), **opts)
    cached = generate_tokens(model, PROMPTS, 24)
    rerun = generate_tokens(model, PROMPTS, 24, use_cache=False)
    alone = [generate_tokens(model, [p], 24, use_cache=False)[0] for p in PROMPTS]
    assert cached == rerun == alone
    assert all(len(t) == 24 for t in cached)
    assert len({tuple(t) for t in cached}) > 1  # different prompts continue differently


def test_mla_generates_through_the_cache():
    """MLA takes the cache (it no longer reruns the context), storing each head's key and its narrower value."""
    from moetrain.model.kv_cache import accepts_cache

    opts = dict(VARIANTS["mla"])
    model = model_of(opts.pop("kind"), **opts)
    assert all(accepts_cache(layer.attention) for layer in model.layers)
    cache = KVCache(len(model.layers), 1, 8)
    with torch.no_grad():
        model(torch.tensor([PROMPTS[0]]), cache=cache)
    assert cache.keys[0].shape == (1, 4, 8, 12) and cache.values[0].shape == (1, 4, 8, 6)


def test_past_max_context_both_paths_rerun_the_window_and_agree():
    model = model_of("moe")
    cached = generate_tokens(model, PROMPTS, 20, max_context=16)
    rerun = generate_tokens(model, PROMPTS, 20, max_context=16, use_cache=False)
    assert cached == rerun
    # the window matters: without it (room for all tokens) the long row continues differently
    assert generate_tokens(model, PROMPTS, 20)[2] != cached[2]


def test_eos_and_stop_strings_end_their_row_only():
    model = model_of("moe")
    free = generate_tokens(model, PROMPTS, 16)
    eos = free[0][4]  # row 0's fifth token
    first_eos = [t.index(eos) if eos in t else None for t in free]
    stopped = generate_tokens(model, PROMPTS, 16, eos_id=eos)
    for row, cut in zip(free, first_eos, strict=True):
        assert stopped[free.index(row)] == (row if cut is None else row[:cut])
    assert stopped == generate_tokens(model, PROMPTS, 16, eos_id=eos, use_cache=False)
    # stop strings over a toy decode (token ids as letters): row 1 stops right after the text appears
    decode = lambda ids: "".join(chr(ord("A") + t % 26) for t in ids)
    target = decode(free[1][5:7])
    stops = [None, stop_at_strings(decode, [target]), stop_at_strings(decode, [""])]
    out = generate_tokens(model, PROMPTS, 16, stop=stops)
    assert out[0] == free[0] and out[2] == free[2]
    end = next(n for n in range(1, 17) if target in decode(free[1][:n]))
    assert out[1] == free[1][:end]


def test_sampling_with_temperature_top_k_top_p_draws_alike_on_both_paths():
    model = model_of("moe")
    kwargs = dict(temperature=0.9, top_k=8, top_p=0.9, seed=7)
    cached = generate_tokens(model, PROMPTS, 16, **kwargs)
    assert cached == generate_tokens(model, PROMPTS, 16, use_cache=False, **kwargs)
    assert cached != generate_tokens(model, PROMPTS, 16)  # it did sample
    assert cached != generate_tokens(model, PROMPTS, 16, **{**kwargs, "seed": 8})


def test_top_k_keeps_the_k_most_likely_and_renormalises():
    probs = torch.tensor([0.1, 0.4, 0.2, 0.3], dtype=torch.float64)
    torch.testing.assert_close(top_k_filter(probs, 2), torch.tensor([0, 4 / 7, 0, 3 / 7], dtype=torch.float64))
    assert torch.equal(top_k_filter(probs, 0), probs)
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0])
    assert {next_token(logits, 5.0, 1.0, gen, top_k=1) for _ in range(50)} == {1}
    assert {next_token(logits, 5.0, 1.0, gen, top_k=2) for _ in range(200)} == {1, 3}


def test_window_attention_through_the_cache_matches_a_float64_softmax():
    """The seam for sliding-window modules: keys more than `window` - 1 positions back are dropped."""
    gen = torch.Generator().manual_seed(0)
    batch, seq, heads, kv_heads, dim, window = 2, 9, 4, 2, 8, 3
    pad = torch.tensor([0, 2])
    q, k, v = (torch.randn(batch, seq, h, dim, generator=gen, dtype=torch.float64) for h in (heads, kv_heads, kv_heads))
    cache = KVCache(1, batch, seq, pad=pad)
    cache.advance(seq)
    out = cache.layer(0).attend(q, k, v, window=window)
    for b in range(batch):
        for i in range(pad[b], seq):
            keys = [j for j in range(pad[b], i + 1) if j > i - window]
            for h in range(heads):
                kh = h // (heads // kv_heads)
                scores = torch.stack([q[b, i, h] @ k[b, j, kh] for j in keys]) / dim ** 0.5
                expected = (torch.softmax(scores, 0).unsqueeze(1) * v[b, keys, kh]).sum(0)
                torch.testing.assert_close(out[b, i, h], expected, atol=1e-12, rtol=0)


def test_bad_cache_use_is_refused():
    model = model_of("dense")
    cache = KVCache(len(model.layers), 1, 4)
    with pytest.raises(ModelError, match="holds 4 slots"):
        model(torch.tensor([[1, 2, 3, 4, 5]]), cache=cache)
    with pytest.raises(ValueError, match="positions from the cache"):
        model(torch.tensor([[1, 2]]), document_ids=torch.zeros(1, 2, dtype=torch.long), cache=cache)
    with pytest.raises(ModelError, match="pad shape"):
        KVCache(2, 3, 8, pad=torch.zeros(2, dtype=torch.long))


def test_an_attention_module_without_a_cache_argument_falls_back_to_rerunning():
    """The seam for modules that cannot use the cache (e.g. a new attention kind): generation still works."""
    from moetrain.model.kv_cache import accepts_cache

    model = model_of("moe")
    expected = generate_tokens(model, PROMPTS, 8, use_cache=False)

    class NoCache(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, positions, plan=None):
            return self.inner(x, positions, plan)

    assert accepts_cache(model.layers[0].attention)
    for layer in model.layers:
        layer.attention = NoCache(layer.attention)
    assert not accepts_cache(model.layers[0].attention)
    assert generate_tokens(model, PROMPTS, 8) == expected


def test_training_after_cached_generation_works():
    """The cached generation runs in inference mode: nothing it leaves on the model (the rerun fallback's
    MoE statistics past max_context) may break the next training step's forward and backward."""
    model = model_of("moe").train()
    generate_tokens(model, PROMPTS, 20, max_context=16)  # cached, then rerunning the window
    assert model.training
    logits = model(torch.tensor(PROMPTS[2][:8]).unsqueeze(0))
    loss = logits.logsumexp(-1).mean() + model.aux_loss()
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
