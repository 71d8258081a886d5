"""torch.compile per block (fullgraph, no recompiles, same losses as eager) and activation checkpointing
modes (selective and every-Nth gradients equal to no checkpointing)."""

import contextlib
from collections import Counter

import pytest
import torch
import torch._dynamo as dynamo
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from moetrain.config.job import parse_job_args
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.config.parallel import ParallelConfig
from moetrain.errors import ConfigError
from moetrain.parallel import parallelize
from moetrain.parallel.parallelize import checkpointing_mode, parallelize_model
from moetrain.train.build import build_model

VOCAB, SEQ = 64, 32


def model_cfg(impl: str, **moe) -> ModelConfig:
    return ModelConfig(vocab_size=VOCAB, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                       n_dense_layers=1, max_seq_len=SEQ,
                       moe=MoEConfig(n_experts=8, top_k=2, expert_hidden=16, impl=impl, **moe))


def batches(n: int):
    """Token rows of two documents each, the boundary moving from batch to batch."""
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        tokens = torch.randint(0, VOCAB, (2, SEQ), generator=g)
        cut = int(torch.randint(4, SEQ - 4, (1,), generator=g))
        docs = torch.cat([torch.zeros(2, cut, dtype=torch.long), torch.ones(2, SEQ - cut, dtype=torch.long)], 1)
        yield tokens, docs


def lm_loss(model, tokens, docs):
    logits = model(tokens, document_ids=docs)
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def train(model, steps: int = 3, on_step=None, after_first_step=contextlib.nullcontext) -> list[tuple[float, float]]:
    """(training loss, held-out loss of the same batch after the step) for `steps` SGD steps;
    the steps after the first (and every evaluation after the first) run inside `after_first_step()`."""
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    losses = []
    with contextlib.ExitStack() as later:
        for step, (tokens, docs) in enumerate(batches(steps)):
            if step == 1:
                later.enter_context(after_first_step())
            losses.append(_step(model, opt, tokens, docs))
            if on_step is not None:
                on_step(step)
    return losses


def _step(model, opt, tokens, docs) -> tuple[float, float]:
    loss = lm_loss(model, tokens, docs) + model.aux_loss()
    loss.backward()
    opt.step()
    opt.zero_grad()
    model.eval()
    with torch.no_grad():
        heldout = lm_loss(model, tokens, docs)
    model.train()
    return loss.item(), heldout.item()


@pytest.mark.parametrize("impl,backend", [("memory_efficient", "inductor"), ("grouped", "aot_eager"),
                                          ("loop", "aot_eager")])
def test_compiled_blocks_match_eager_without_breaks_or_recompiles(impl, backend, monkeypatch):
    monkeypatch.setattr(parallelize, "COMPILE_BACKEND", backend)
    cfg = model_cfg(impl, load_balance="aux_loss", aux_loss_coef=0.01)
    eager = train(build_model(cfg, seed=0).train())
    dynamo.reset()
    counters.clear()
    graphs_after_step = []
    compiled_model = build_model(cfg, seed=0, compile=True).train()
    assert compiled_model.attention_method == "dense"  # auto pinned: a mask of the same shape every batch
    # The first step compiles the dense block and then the MoE blocks (one graph for both: the
    # second MoE block reuses the first's); from then on any recompilation raises, in training
    # and in evaluation (fullgraph=True raises on any graph break).
    compiled = train(compiled_model, on_step=lambda step: graphs_after_step.append(counters["stats"]["unique_graphs"]),
                     after_first_step=lambda: dynamo.config.patch(error_on_recompile=True))
    assert graphs_after_step == [2, 2, 2]
    assert not counters["graph_break"]
    for (loss_e, heldout_e), (loss_c, heldout_c) in zip(eager, compiled, strict=True):
        assert loss_c == pytest.approx(loss_e, rel=1e-5)
        assert heldout_c == pytest.approx(heldout_e, rel=1e-5)
    assert eager[0][0] != pytest.approx(eager[-1][0], rel=1e-3)  # the steps did train


def test_compile_rejects_layouts_that_change_shape():
    for attention in ("segments", "blocks"):
        cfg = model_cfg("memory_efficient")
        cfg.attention = attention
        with pytest.raises(ConfigError, match="model.attention"):
            build_model(cfg, compile=True)
    with pytest.raises(ConfigError, match="token_rounding_tile"):
        build_model(model_cfg("memory_efficient", token_rounding_tile=4), compile=True)
    with pytest.raises(ConfigError, match="selective"):
        build_model(model_cfg("memory_efficient"), compile=True, activation_checkpointing="selective")


def gradients(cfg: ModelConfig, mode, every: int = 1) -> tuple[float, dict[str, torch.Tensor]]:
    model = build_model(cfg, seed=0, activation_checkpointing=mode, activation_checkpointing_every=every).train()
    tokens, docs = next(batches(1))
    loss = lm_loss(model, tokens, docs) + model.aux_loss()
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("impl", ["memory_efficient", "grouped", "loop"])
@pytest.mark.parametrize("mode,every", [("selective", 1), ("full", 2), ("selective", 2), (True, 1)])
def test_checkpointing_gradients_equal_no_checkpointing(impl, mode, every):
    cfg = model_cfg(impl, load_balance="aux_loss", aux_loss_coef=0.01)
    loss_ref, grads_ref = gradients(cfg, "none")
    loss, grads = gradients(cfg, mode, every)
    assert loss == loss_ref
    assert grads.keys() == grads_ref.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_ref[name], rtol=1e-6, atol=1e-7, msg=name)


class OpCounter(TorchDispatchMode):
    """Counts every aten op that runs while it is active."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket] += 1
        return func(*args, **(kwargs or {}))


def backward_ops(mode, impl: str) -> Counter:
    model = build_model(model_cfg(impl), seed=0, activation_checkpointing=mode).train()
    tokens, docs = next(batches(1))
    loss = lm_loss(model, tokens, docs)
    with OpCounter() as counter:
        loss.backward()
    return counter.counts


@pytest.mark.parametrize("impl", ["memory_efficient", "grouped"])
def test_selective_policy_keeps_matmuls_and_recomputes_the_cheap_ops(impl):
    """Backward under selective runs no more GEMMs than without checkpointing (their outputs were
    kept), unlike full, which reruns the forward's; it does rerun the cheap ops (RMSNorm's rsqrt)."""
    none, selective, full = (backward_ops(mode, impl) for mode in ("none", "selective", "full"))
    # The memory-efficient MoE layer is one operator around its GEMMs: the counter sees it, not them.
    gemms = (torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.addmm, torch.ops.moetrain.memory_efficient_experts)
    assert sum(full[op] for op in gemms) > sum(none[op] for op in gemms)
    assert sum(selective[op] for op in gemms) == sum(none[op] for op in gemms)
    assert selective[torch.ops.aten.rsqrt] > none[torch.ops.aten.rsqrt]


def test_checkpointing_mode_parsing():
    assert checkpointing_mode(True) == "full"
    assert checkpointing_mode(False) == "none"
    assert checkpointing_mode("selective") == "selective"
    with pytest.raises(ConfigError, match="train.activation_checkpointing"):
        checkpointing_mode("sometimes")
    with pytest.raises(ConfigError, match="activation_checkpointing_every"):
        parallelize_model(build_model(model_cfg("loop"), weights="none"), None, ParallelConfig(),
                          activation_checkpointing="full", activation_checkpointing_every=0)


def test_toml_keeps_the_boolean_form(tmp_path):
    for value, mode in (("true", "full"), ("false", "none"), ('"selective"', "selective")):
        path = tmp_path / "job.toml"
        path.write_text(f"[train]\nactivation_checkpointing = {value}\nactivation_checkpointing_every = 2\n")
        cfg = parse_job_args(["--config", str(path)])
        assert checkpointing_mode(cfg.train.activation_checkpointing) == mode
        assert cfg.train.activation_checkpointing_every == 2
    path.write_text('[train]\nactivation_checkpointing = "sometimes"\n')
    with pytest.raises(ConfigError, match="train.activation_checkpointing"):
        parse_job_args(["--config", str(path)])
    path.write_text("[train]\nactivation_checkpointing_every = 0\n")
    with pytest.raises(ConfigError, match="train.activation_checkpointing_every"):
        parse_job_args(["--config", str(path)])
