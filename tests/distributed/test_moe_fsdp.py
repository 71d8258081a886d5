"""The memory-efficient expert Function under FSDP2: expert weights (and the router) sharded on
dim 0 (the expert dimension) over 2 gloo ranks; forward + backward must give the same gradients
as the unsharded layer averaged over both ranks' inputs, computed in one float64 process."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moetrain.model.experts import routed_experts
from moetrain.model.routing import routing_from_topk
from moetrain.testing import run_on_ranks

N_EXPERTS, DIM, INNER, TOKENS, TOP_K = 4, 16, 8, 12, 2


class TinyMoE(nn.Module):
    """Router + stacked SwiGLU experts; the score gradient reaches the router through autograd."""

    def __init__(self, impl: str) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.impl = impl
        self.router = nn.Parameter(torch.randn(N_EXPERTS, DIM, generator=gen, dtype=torch.float64))
        self.w1 = nn.Parameter(torch.randn(N_EXPERTS, DIM, 2 * INNER, generator=gen, dtype=torch.float64) * 0.3)
        self.w2 = nn.Parameter(torch.randn(N_EXPERTS, INNER, DIM, generator=gen, dtype=torch.float64) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = (x @ self.router.t()).softmax(-1)
        top_scores, top_idx = probs.topk(TOP_K, dim=-1)
        routing = routing_from_topk(top_idx, top_scores / top_scores.sum(-1, keepdim=True), N_EXPERTS)
        return routed_experts(x, routing, self.w1, self.w2, "swiglu", self.impl)


def rank_inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(TOKENS, DIM, generator=gen, dtype=torch.float64),
            torch.randn(TOKENS, DIM, generator=gen, dtype=torch.float64))


def unsharded_mean_grads(world_size: int) -> dict[str, torch.Tensor]:
    """Reference: the plain per-expert loop, gradients averaged over every rank's batch (FSDP's mean)."""
    model = TinyMoE("loop")
    for rank in range(world_size):
        x, grad_out = rank_inputs(rank)
        model(x).backward(grad_out / world_size)
    return {name: p.grad for name, p in model.named_parameters()}


def sharded_grads() -> dict[str, object]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size,))
    model = TinyMoE("memory_efficient")
    fully_shard(model, mesh=mesh)
    placements = {name: tuple(p.placements) for name, p in model.named_parameters() if isinstance(p, DTensor)}
    local_rows = {name: p.to_local().shape[0] for name, p in model.named_parameters()}
    x, grad_out = rank_inputs(rank)
    model(x).backward(grad_out)
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    reference = unsharded_mean_grads(world_size)
    errors = {name: ((grads[name] - reference[name]).norm() / reference[name].norm()).item() for name in grads}
    return {"placements_ok": all(pl == (Shard(0),) for pl in placements.values()) and len(placements) == 3,
            "local_rows": local_rows, "errors": errors}


def test_memory_efficient_experts_under_fsdp2_match_unsharded_gradients():
    results = run_on_ranks(sharded_grads, 2, timeout=120)
    for rank, result in enumerate(results):
        assert result["placements_ok"], rank
        # 4 experts over 2 ranks: each rank holds 2 experts of w1/w2 (and 2 router rows)
        assert result["local_rows"] == {"router": 2, "w1": 2, "w2": 2}
        for name, err in result["errors"].items():
            assert err < 1e-10, (rank, name, err)
