"""train.float8 under FSDP 2 against one process with float8: the same losses, and the checkpoint's weights unchanged.

Both sides run moetrain's own paths (build_model with float8, FSDP's MixedPrecisionPolicy on 2 ranks, the
one-rank compute copies in one process) over the same global batch, each rank's microbatches as separate
forwards in both, SGD for 3 steps.

- tensorwise, param_dtype float32: FSDP all-gathers the weights in float8, each rank casting its shard
  with the scale of the whole weight (the scales precomputed after each optimizer step, as the trainer
  does); one process casts the whole float32 weight. The float8 weights are the same bits, so step 0's
  loss is the same bits; the later steps differ only through the float32 gradient sums (reduce-scatter
  across ranks against one process's accumulation: relative 1e-7), which can move a weight across a
  float8 rounding boundary (one element by <= 2^-4 of itself): measured below 1e-6 relative, asserted
  within 1e-5.
- rowwise, param_dtype bfloat16: rowwise scales cannot be cut per shard, so FSDP gathers bf16 weights,
  the same bf16 values one process's compute copies hold: the same bound.

The routed experts run their grouped GEMMs in float8 in every case (torchao's rowwise grouped recipe, weights
gathered in param_dtype), through the memory-efficient layer and, in the last row, the standard-autograd one:
each microbatch's expert groups and scales are the same in both runs, so the same bound holds.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from parity_support import load_full_state

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.config.parallel import ParallelConfig
from moetrain.data.packing import IGNORE_INDEX
from moetrain.model.transformer import Transformer
from moetrain.testing import run_on_ranks
from moetrain.train.loss import microbatch_loss, token_loss_sum

pytest.importorskip("torchao.float8")

WORLD, STEPS, MICRO, LR = 2, 3, 2, 0.3
CFG = ModelConfig(vocab_size=64, dim=32, n_layers=2, n_dense_layers=1, n_heads=2, ffn_hidden=64, max_seq_len=16,
                  moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, n_shared_experts=1))
# (linears' recipe, param_dtype, moe.impl)
CASES = [("tensorwise", "float32", "memory_efficient"), ("rowwise", "bfloat16", "memory_efficient"),
         ("rowwise", "bfloat16", "grouped")]


def with_impl(impl: str) -> ModelConfig:
    return dataclasses.replace(CFG, moe=dataclasses.replace(CFG.moe, impl=impl))


def initial_state() -> dict[str, torch.Tensor]:
    model = Transformer(CFG)
    model.init_weights(seed=0)
    return {k: v.clone() for k, v in model.state_dict().items()}


def batches() -> list[list[list[tuple[torch.Tensor, torch.Tensor]]]]:
    """[step][rank][microbatch] -> (tokens, targets), some targets masked."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        ranks = []
        for _ in range(WORLD):
            mbs = []
            for _ in range(MICRO):
                tokens = torch.randint(0, CFG.vocab_size, (2, 12), generator=gen)
                targets = torch.randint(0, CFG.vocab_size, (2, 12), generator=gen)
                targets[torch.rand(2, 12, generator=gen) < 0.2] = IGNORE_INDEX
                mbs.append((tokens, targets))
            ranks.append(mbs)
        out.append(ranks)
    return out


def train(model, microbatches_of_step, step_hook=None, compute=None, on_end=None) -> list[float]:
    """Losses (token-weighted over the whole global batch) of STEPS SGD steps on this rank's microbatches;
    `on_end(model, optimizer)` after the last step."""
    import contextlib

    import torch.distributed as dist

    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        mbs = microbatches_of_step(step)
        local = torch.tensor([float(sum(int((t != IGNORE_INDEX).sum()) for _, t in mbs)), 0.0], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(local)
        global_tokens = int(local[0])
        with compute() if compute is not None else contextlib.nullcontext():
            for tokens, targets in mbs:
                loss_sum, n_valid = token_loss_sum(model(tokens), targets)
                microbatch_loss(loss_sum, n_valid, global_tokens, model.aux_loss()).backward()
                local[1] += float(loss_sum.detach())
        optimizer.step()
        optimizer.zero_grad()
        if step_hook is not None:
            step_hook(model)
        loss_sum = local[1:].clone()
        if dist.is_initialized():
            dist.all_reduce(loss_sum)
        losses.append(float(loss_sum / global_tokens))
    if on_end is not None:
        on_end(model, optimizer)
    return losses


def one_process(state, data, recipe: str, param_dtype: str, impl: str) -> list[float]:
    from moetrain.parallel.precision import compute_copy
    from moetrain.train.build import build_model

    parallel = ParallelConfig(param_dtype=param_dtype)
    model = build_model(with_impl(impl), parallel, None, "cpu", weights="none", float8=recipe)
    load_full_state(model, state)
    copies = compute_copy(model, parallel)
    return train(model, lambda step: [mb for rank in data[step] for mb in rank],
                 compute=copies.compute if copies is not None else None)


def sharded(state, data, recipe: str, param_dtype: str, impl: str, checkpoint_dir: str):
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from moetrain.parallel.float8 import precompute_float8_scales
    from moetrain.parallel.mesh import JobMesh
    from moetrain.parallel.process_group import init_distributed
    from moetrain.train.build import build_model

    rank, world, device = init_distributed(ParallelConfig())
    parallel = ParallelConfig(dp_shard=world, param_dtype=param_dtype)
    job = JobMesh.from_config(parallel, world, device)
    cfg = with_impl(impl)
    model = build_model(cfg, parallel, job, device, weights="none", float8=recipe)
    load_full_state(model, state)
    experts_in_float8 = [name for name, module in model.named_modules() if getattr(module, "expert_float8", False)]
    gathered_in_float8 = sorted(n for n, p in model.named_parameters()
                                if isinstance(p.to_local(), WeightWithDynamicFloat8CastTensor))
    plain = build_model(cfg, parallel, job, device, weights="none")
    keys = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    plain_keys = {k: (tuple(v.shape), v.dtype) for k, v in plain.state_dict().items()}
    from moetrain.checkpoint.storage import load_checkpoint, save_checkpoint

    saved = []
    losses = train(model, lambda step: data[step][rank], step_hook=precompute_float8_scales,
                   on_end=lambda m, opt: saved.append(save_checkpoint(checkpoint_dir, STEPS, m, opt, {}, {}, 1)))
    full = {n: p.full_tensor().detach().float().numpy() for n, p in model.named_parameters()}
    # Resume: a fresh float8 model loading the checkpoint has the same weights and the next step's loss bit for bit.
    resumed = build_model(cfg, parallel, job, device, weights="none", float8=recipe)
    load_checkpoint(saved[0], resumed, torch.optim.SGD(resumed.parameters(), lr=LR))
    same_weights = all(torch.equal(a.full_tensor(), b.full_tensor())
                       for a, b in zip(model.parameters(), resumed.parameters(), strict=True))
    tokens, targets = data[0][rank][0]
    next_losses = [float(token_loss_sum(m(tokens), targets)[0]) for m in (model, resumed)]
    return (losses, gathered_in_float8, keys == plain_keys, full, str(saved[0].path), same_weights, next_losses,
            experts_in_float8)


@pytest.mark.parametrize("recipe, param_dtype, impl", CASES)
def test_fsdp2_float8_losses_equal_one_process(recipe, param_dtype, impl, tmp_path):
    from moetrain.checkpoint.layout import CheckpointRef
    from moetrain.checkpoint.storage import load_model_weights

    state, data = initial_state(), batches()
    expected = one_process(state, data, recipe, param_dtype, impl)
    results = run_on_ranks(sharded, WORLD, state, data, recipe, param_dtype, impl, str(tmp_path))
    losses, gathered, same_keys, full, checkpoint, resumed_weights, next_losses, experts = results[0]
    assert experts == ["layers.1.moe"]
    assert all(math.isfinite(x) for x in expected)
    assert losses[0] == expected[0], (losses, expected)  # the same float8 weights: the same bits
    for got, want in zip(losses, expected, strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (losses, expected)
    assert results[1][0] == losses
    # Float8 all-gather exactly where torchao offers it: tensorwise, every converted linear's weight.
    float8_weights = {f"{n}.weight" for n in ("layers.0.attention.wq", "layers.0.attention.wk", "layers.0.attention.wv",
                                             "layers.0.attention.wo", "layers.0.feed_forward.w1",
                                             "layers.0.feed_forward.w2", "layers.0.feed_forward.w3",
                                             "layers.1.attention.wq", "layers.1.attention.wk", "layers.1.attention.wv",
                                             "layers.1.attention.wo", "layers.1.moe.shared_expert.w1",
                                             "layers.1.moe.shared_expert.w2", "layers.1.moe.shared_expert.w3")}
    assert set(gathered) == (float8_weights if recipe == "tensorwise" else set())
    # What a checkpoint saves: the same keys, shapes and float32 dtypes as without float8, and the trained
    # float32 masters, bit for bit, in a plain model loading it in one process (as export-hf does).
    assert same_keys
    assert resumed_weights and next_losses[0] == next_losses[1]
    plain = Transformer(CFG)
    load_model_weights(CheckpointRef(STEPS, Path(checkpoint)), plain)
    for name, param in plain.named_parameters():
        assert param.dtype == torch.float32 and torch.equal(param.detach(), torch.from_numpy(full[name])), name
