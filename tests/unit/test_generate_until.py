"""`generate_until` of the lm-evaluation-harness adapter: stop strings, sampling settings, batching.

The reference for stop strings is the greedy continuation without any: the text with a stop string
must be that continuation cut before the string's first occurrence. Sampling settings follow the hf
backend's reading of `gen_kwargs` (do_sample=False is greedy whatever the temperature), and a
sampled request draws exactly what `generate_tokens` draws with the same settings and seed.
"""

from types import SimpleNamespace

import pytest
import torch

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.data.tokenizer import build_tokenizer
from moetrain.evaluate.generate import generate_tokens
from moetrain.evaluate.harness import _gen_settings, harness_model
from moetrain.train.build import build_model

pytest.importorskip("lm_eval")
PROMPTS = ["def f(x):", "import o", "class A"]


@pytest.fixture(scope="module")
def lm():
    cfg = ModelConfig(vocab_size=259, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, n_dense_layers=1,
                      max_seq_len=128, moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16))
    return harness_model(build_model(cfg, seed=2, init_scheme="gpt2"), build_tokenizer("byte"), batch_size=2,
                         max_length=96, seed=5)


def requests(gen_kwargs: dict, prompts=PROMPTS) -> list:
    return [SimpleNamespace(args=(prompt, dict(gen_kwargs))) for prompt in prompts]


def test_gen_kwargs_read_as_the_hf_backend_reads_them():
    assert _gen_settings({"until": "\n"}, 7) == (["\n"], {"max_new_tokens": 7, "temperature": 0.0, "top_p": 1.0,
                                                          "top_k": 0})
    until, settings = _gen_settings({"until": ["a", "b"], "do_sample": True, "temperature": 0.7, "top_p": 0.9,
                                     "top_k": 5, "max_gen_toks": 3}, 7)
    assert until == ["a", "b"] and settings == {"max_new_tokens": 3, "temperature": 0.7, "top_p": 0.9, "top_k": 5}
    assert _gen_settings({"do_sample": False, "temperature": 0.7}, 7)[1]["temperature"] == 0.0
    assert _gen_settings({"temperature": 0.7}, 7)[1]["temperature"] == 0.7


def test_stop_strings_cut_the_greedy_text_before_their_first_occurrence(lm):
    free = lm.generate_until(requests({"until": [], "max_gen_toks": 24}))
    assert all(len(text) > 4 for text in free)
    stop = free[1][3:5]  # occurs in row 1's continuation; maybe in the others
    cut = lm.generate_until(requests({"until": [stop], "max_gen_toks": 24}))
    assert cut == [text.split(stop)[0] for text in free]
    assert len(cut[1]) == 3 or stop in free[1][:3]


def test_sampled_requests_draw_what_generate_tokens_draws(lm):
    settings = {"do_sample": True, "temperature": 1.5, "top_p": 0.9, "top_k": 20, "max_gen_toks": 16, "until": []}
    sampled = lm.generate_until(requests(settings))
    greedy = lm.generate_until(requests({"max_gen_toks": 16, "until": []}))
    assert sampled != greedy
    assert lm.generate_until(requests({**settings, "do_sample": False})) == greedy
    # the adapter batches 2 prompts at a time with its seed: the same draws, batch by batch
    prompts = [lm.tok_encode(p) for p in PROMPTS]
    want = []
    for start in range(0, len(prompts), 2):
        new = generate_tokens(lm.model, prompts[start:start + 2], 16, eos_id=lm.eot_token_id, temperature=1.5,
                              top_p=0.9, top_k=20, seed=5, max_context=96)
        want += [lm.tok_decode(tokens) for tokens in new]
    assert sampled == want
    torch.manual_seed(0)  # the adapter's draws do not depend on the global generator
    assert lm.generate_until(requests(settings)) == sampled
