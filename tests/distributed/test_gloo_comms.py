"""FSDP's gloo comms (moetrain.parallel.gloo_comms) against gloo's own collectives and a float64 sum.

On 4 gloo ranks, for float32 and bfloat16 buffers of a size that is no power of two:
- BroadcastAllGather gives bitwise the output of `all_gather_into_tensor`, with the input in its
  slot already (how FSDP calls it) and as a separate tensor, synchronously and through the Work
  FSDP waits on;
- PointToPointReduceScatter gives each rank the sum of its chunk over all ranks: bitwise the
  rank-ordered sum every rank can compute from the seeds, within one rounding of the float64 sum,
  and for float32 within rounding of `reduce_scatter_tensor` (a different association); MAX falls
  back to gloo's reduce-scatter and matches it bitwise;
- apply_fsdp installs both on every single-mesh unit on gloo, so the parity grid
  (test_parity.py: FSDP, HSDP, replicate x sync policies x precisions) runs them.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from moetrain.testing import run_on_ranks

WORLD = 4
CHUNK = 1237  # elements per rank: odd, so a mix-up of chunk boundaries cannot cancel out


def _rank_input(rank: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(numel, generator=generator, dtype=torch.float64).to(dtype)


def _comms_worker():
    from moetrain.parallel.gloo_comms import BroadcastAllGather, PointToPointReduceScatter

    rank, group = dist.get_rank(), dist.group.WORLD
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).split(".")[-1]
        shard = _rank_input(rank, dtype, CHUNK)
        expected = torch.empty(WORLD * CHUNK, dtype=dtype)
        dist.all_gather_into_tensor(expected, shard)
        # As FSDP calls it: the input is this rank's slot of the output, asynchronously.
        in_place = torch.full((WORLD * CHUNK,), float("nan"), dtype=dtype)
        in_place.view(WORLD, -1)[rank].copy_(shard)
        work = BroadcastAllGather()(in_place, in_place.view(WORLD, -1)[rank], group, async_op=True)
        work.wait()
        separate = torch.empty(WORLD * CHUNK, dtype=dtype)
        assert BroadcastAllGather()(separate, shard, group) is None
        out[f"ag_{name}"] = (torch.equal(in_place, expected), torch.equal(separate, expected))

        full = _rank_input(rank, dtype, WORLD * CHUNK)
        mine = torch.empty(CHUNK, dtype=dtype)
        PointToPointReduceScatter()(mine, full, group, dist.ReduceOp.SUM)
        inputs = [_rank_input(r, dtype, WORLD * CHUNK).view(WORLD, -1)[rank] for r in range(WORLD)]
        ordered = inputs[0].clone()
        for part in inputs[1:]:
            ordered += part
        exact = torch.stack([t.double() for t in inputs]).sum(0)
        gloo = torch.empty(CHUNK, dtype=dtype)
        dist.reduce_scatter_tensor(gloo, full.clone())
        maxed, gloo_max = torch.empty(CHUNK, dtype=dtype), torch.empty(CHUNK, dtype=dtype)
        PointToPointReduceScatter()(maxed, full.clone(), group, dist.ReduceOp.MAX)
        dist.reduce_scatter_tensor(gloo_max, full.clone(), op=dist.ReduceOp.MAX)
        out[f"rs_{name}"] = {
            "ordered": torch.equal(mine, ordered),
            "vs_float64": ((mine.double() - exact).abs().max() / exact.abs().max()).item(),
            "vs_gloo": ((mine.double() - gloo.double()).abs().max() / exact.abs().max()).item(),
            "max_fallback": torch.equal(maxed, gloo_max),
        }
    return out


def test_gather_and_reduce_scatter_match_gloo_and_the_exact_sum():
    results = run_on_ranks(_comms_worker, WORLD, timeout=300)
    for rank, result in enumerate(results):
        for name in ("float32", "bfloat16"):
            assert result[f"ag_{name}"] == (True, True), (rank, name)
            rs = result[f"rs_{name}"]
            assert rs["ordered"] and rs["max_fallback"], (rank, name, rs)
            # WORLD - 1 additions, each rounding once: within 3 units of the dtype's rounding.
            unit = torch.finfo(getattr(torch, name)).eps
            assert rs["vs_float64"] <= 3 * unit, (rank, name, rs)
            if name == "float32":
                assert rs["vs_gloo"] <= 6 * unit, (rank, rs)


class _TwoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

    def forward(self, x):
        return self.layers[1](self.layers[0](x))


def _installed_worker():
    from torch.distributed.fsdp import FSDPModule

    from moetrain.config.parallel import ParallelConfig
    from moetrain.parallel.gloo_comms import BroadcastAllGather, PointToPointReduceScatter
    from moetrain.parallel.mesh import JobMesh, MeshDims
    from moetrain.parallel.shard import apply_fsdp

    model = _TwoLayers()
    apply_fsdp(model, JobMesh.build(MeshDims(dp_shard=2), "cpu"), ParallelConfig(dp_shard=2))
    kinds = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                kinds.append((type(group._all_gather_comm), type(group._reduce_scatter_comm)))
    loss = model(torch.ones(3, 8)).sum()
    loss.backward()
    return kinds == [(BroadcastAllGather, PointToPointReduceScatter)] * len(kinds) and len(kinds) == 2


def test_apply_fsdp_installs_them_on_gloo():
    assert run_on_ranks(_installed_worker, 2, timeout=300) == [True, True]
