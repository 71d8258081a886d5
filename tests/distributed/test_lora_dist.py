"""LoRA under FSDP 2 x EP 2 on 4 gloo ranks against one float64 process.

The parity grid's tiny transformer (2 dense + 2 MoE layers, a shared expert added) with adapters on every
target (attention, dense feed-forward, shared expert, per-expert routed adapters, router), every adapter
random (B too, so every gradient is non-zero). Each rank runs its own uneven microbatches of step 0
(one has no valid target); the gathered adapter gradients must equal the float64 single process's over
the whole global batch to 1e-5 relative, the base must hold no gradient, and after two AdamW
steps the frozen base weights (sharded by EP and FSDP alike) must be bitwise what they were.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from parity_support import MODEL_CFG, initial_state, load_full_state, make_batches, relative_error

from moetrain.config.lora import LoraConfig
from moetrain.config.parallel import ParallelConfig
from moetrain.data.packing import IGNORE_INDEX
from moetrain.model.lora import adapter_parameters, apply_lora
from moetrain.model.transformer import Transformer
from moetrain.testing import run_on_ranks
from moetrain.train.build import build_model
from moetrain.train.loss import microbatch_loss, token_loss_sum

BOUND = 1e-5
CFG = dataclasses.replace(MODEL_CFG, moe=dataclasses.replace(MODEL_CFG.moe, n_shared_experts=1))
LORA = LoraConfig(rank=2, alpha=3.0, targets=["attention", "ffn", "shared_experts", "experts", "router"])


def lora_state() -> dict[str, torch.Tensor]:
    """Base weights of the parity grid's init and random adapters, all float32."""
    model = Transformer(CFG)
    apply_lora(model, LORA)
    gen = torch.Generator().manual_seed(7)
    state = {}
    base = initial_state() | {k: v for k, v in _shared_expert_init(model).items()}
    for name, tensor in model.state_dict().items():
        state[name] = (0.3 * torch.randn(tensor.shape, generator=gen) if ".lora_" in name else base[name]).float()
    return state


def _shared_expert_init(model: Transformer) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {name: torch.randn(t.shape, generator=gen) / t.shape[-1] ** 0.5
            for name, t in model.state_dict().items() if "shared_expert." in name and ".lora_" not in name}


def _n_valid(microbatches) -> int:
    return sum(int((t != IGNORE_INDEX).sum()) for _, t in microbatches)


def reference_grads(state, batches) -> dict[str, torch.Tensor]:
    model = Transformer(CFG)
    apply_lora(model, LORA)
    model.load_state_dict(state)
    model.double()
    everything = [mb for rank in batches[0] for mb in rank]
    global_tokens = _n_valid(everything)
    for tokens, targets in everything:
        loss_sum, n_valid = token_loss_sum(model(tokens), targets)
        microbatch_loss(loss_sum, n_valid, global_tokens, model.aux_loss()).backward()
    return {name: p.grad.detach().clone() for name, p in adapter_parameters(model).items()}


def worker(state, batches):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from moetrain.parallel.grad_sync import count_global_tokens
    from moetrain.parallel.mesh import JobMesh

    rank, world = dist.get_rank(), dist.get_world_size()
    pcfg = ParallelConfig(dp_shard=4, ep=2)
    model = build_model(CFG, pcfg, JobMesh.from_config(pcfg, world, torch.device("cpu")), weights="none", lora=LORA)
    load_full_state(model, state)

    def full(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().numpy().copy()

    microbatches = batches[0][rank]
    global_tokens = count_global_tokens(_n_valid(microbatches))
    for tokens, targets in microbatches:
        loss_sum, n_valid = token_loss_sum(model(tokens), targets)
        microbatch_loss(loss_sum, n_valid, global_tokens, model.aux_loss()).backward()
    adapters = adapter_parameters(model)
    grads = {name: full(p.grad) for name, p in adapters.items()}
    base_grads = [name for name, p in model.named_parameters() if name not in adapters and p.grad is not None]
    optimizer = torch.optim.AdamW(adapters.values(), lr=1e-2)
    for step in (1,):
        optimizer.step()
        optimizer.zero_grad()
        microbatches = batches[step][rank]
        global_tokens = count_global_tokens(_n_valid(microbatches))
        for tokens, targets in microbatches:
            loss_sum, n_valid = token_loss_sum(model(tokens), targets)
            microbatch_loss(loss_sum, n_valid, global_tokens, model.aux_loss()).backward()
    optimizer.step()
    base = {name: full(p) for name, p in model.named_parameters() if name not in adapters}
    moved = {name: full(p) for name, p in adapters.items()}
    return (grads, base_grads, base, moved) if rank == 0 else None


def test_adapter_gradients_under_fsdp2_ep2_equal_float64_and_the_base_stays_unchanged():
    state = lora_state()
    batches = make_batches(n_steps=2)
    grads, base_grads, base, moved = run_on_ranks(worker, 4, state, batches, timeout=240)[0]
    want = reference_grads(state, batches)
    assert set(grads) == set(want) and base_grads == []
    got = {name: torch.from_numpy(g).double() for name, g in grads.items()}
    error, where = relative_error(got, want)
    assert error < BOUND, (error, where)
    assert all(float(w.abs().max()) > 0 for w in want.values())  # every adapter takes a gradient
    for name, value in base.items():
        assert np.array_equal(value, state[name].numpy()), name
    assert any(not np.array_equal(value, state[name].numpy()) for name, value in moved.items())
