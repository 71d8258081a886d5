"""Init on FSDP2-sharded (DTensor) parameters: each rank fills its own shard; same values as unsharded."""

import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from moetrain.commands.init_report import build_initialised, report_rows
from moetrain.config.job import load
from moetrain.model.transformer import Transformer
from moetrain.testing import run_on_ranks

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny_moe.toml"
SCHEMES = ("llama", "olmo-mitchell")  # fused halves with different stds; a binding ±3σ cutoff


def _init_sharded(config_path: str, schemes: tuple[str, ...]):
    cfg = load(config_path).model
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    with torch.device("meta"):
        model = Transformer(cfg)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    out = {}
    for scheme in schemes:
        model.init_weights(seed=5, scheme=scheme)
        local = {name: (tuple(p.to_local().shape), tuple(p.shape), p.to_local().abs().max().item()
                        if p.to_local().numel() else 0.0)
                 for name, p in model.named_parameters()}
        rows = report_rows(model, scheme)  # gathers full tensors (a collective on every rank)
        reference = build_initialised(cfg, scheme, seed=5)  # unsharded, in this process
        mismatched = [name for name, p in model.named_parameters()
                      if not torch.equal(p.full_tensor(), reference.get_parameter(name))]
        buffers_zero = all(bool((b == 0).all()) for name, b in model.named_buffers() if "expert" in name
                           or "load" in name)
        out[scheme] = (rows, local, mismatched, buffers_zero)
    return out


def test_sharded_init_has_the_target_distribution_and_equals_the_unsharded_init():
    results = run_on_ranks(_init_sharded, 2, str(TINY), SCHEMES, timeout=120)
    for scheme in SCHEMES:
        rows, _, _, _ = results[0][scheme]
        for rank_result in results:
            _, local, mismatched, buffers_zero = rank_result[scheme]
            assert mismatched == [], (scheme, mismatched)
            assert buffers_zero
            # the test exercises real shards: big parameters are split along dim 0
            emb_local, emb_global, _ = local["tok_embeddings.weight"]
            assert emb_local[0] < emb_global[0]
        for row in rows:
            if row["dist"] == "ones":
                assert row["measured_mean"] == 1 and row["measured_std"] == 0
            elif row["numel"] >= 10_000:
                assert abs(row["measured_std"] / row["target_std"] - 1) < 0.05, (scheme, row)
                assert abs(row["measured_mean"]) < 6 * row["target_std"] / math.sqrt(row["numel"]), (scheme, row)
            if row["cutoff"] is not None:
                assert row["max_abs"] <= row["cutoff"], (scheme, row)
        # every rank's local shard respects the cutoff of its parameter (checked before any gather)
        cutoffs = {}
        for row in rows:
            base = row["name"].split("[")[0]
            if row["cutoff"] is not None:
                cutoffs[base] = max(cutoffs.get(base, 0.0), row["cutoff"])
        for rank_result in results:
            _, local, _, _ = rank_result[scheme]
            for name, (_, _, max_abs) in local.items():
                if name in cutoffs:
                    assert max_abs <= cutoffs[name], (scheme, name)
