"""Mesh, sharding layout, sync-flag behaviour, token counting, clipping and HSDP training on 4 gloo ranks.

One 4-rank spawn serves every multi-rank check here (module fixture); a plain
subprocess covers the single-process path without any launcher environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from parity_support import (
    MODEL_CFG,
    initial_state,
    load_full_state,
    make_batches,
    reference_run,
    relative_error,
)

from moetrain.config.parallel import ParallelConfig
from moetrain.data.packing import IGNORE_INDEX
from moetrain.errors import ConfigError
from moetrain.parallel.mesh import JobMesh
from moetrain.testing import run_on_ranks
from moetrain.train.build import build_model

SHAPES = [(1, 4), (2, 2), (4, 1)]


def valid_targets(targets: torch.Tensor) -> int:
    return int((targets != IGNORE_INDEX).sum())


def _sharded_model(shape, device, pcfg=None, state=None):

    pcfg = pcfg or ParallelConfig(dp_replicate=shape[0], dp_shard=shape[1])
    mesh = JobMesh.from_config(pcfg, torch.distributed.get_world_size(), device)
    model = build_model(MODEL_CFG, pcfg, mesh, device, weights="none")
    load_full_state(model, state if state is not None else initial_state(0))
    return model, mesh, pcfg


def _step_grads(model, microbatches, policy):
    from moetrain.parallel.grad_sync import accumulation, count_global_tokens
    from moetrain.train.loss import microbatch_loss, token_loss_sum

    global_tokens = count_global_tokens(sum(valid_targets(t) for _, t in microbatches))
    for (tokens, targets), _ in accumulation(model, microbatches, policy):
        loss_sum, n_valid = token_loss_sum(model(tokens), targets)
        microbatch_loss(loss_sum, n_valid, global_tokens, model.aux_loss()).backward()
    return global_tokens


def _worker():
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard

    from moetrain.parallel.grad_sync import (
        SYNC_POLICIES,
        accumulation,
        clip_grad_norm_,
        count_global_tokens,
        resolve_sync_policy,
    )
    from moetrain.parallel.process_group import init_distributed
    from moetrain.train.loss import microbatch_loss, token_loss_sum

    rank, world, device = init_distributed(ParallelConfig())
    out: dict = {"rank": rank, "world": world, "device": str(device)}

    # Layout: which mesh fully_shard got and how a weight is placed.
    out["layout"] = {}
    for shape in [*SHAPES, (2, -1)]:
        model, mesh, _ = _sharded_model(shape, device, ParallelConfig(dp_replicate=shape[0], dp_shard=shape[1]))
        weight = model.layers[0].attention.wq.weight
        out["layout"][shape] = (tuple(mesh.data.shape), tuple(weight.device_mesh.shape),
                                tuple(repr(p) for p in weight.placements), tuple(weight.to_local().shape))
        assert weight.placements[-1] == Shard(0) and all(p == Replicate() for p in weight.placements[:-1])

    # Sync flags change behaviour: after a non-last microbatch, is the sharded gradient
    # already reduced (FSDP assigns .grad) or held back?
    batches = make_batches(0)
    out["reduced_after_first"] = {}
    for shape in [(1, 4), (2, 2)]:
        for name, policy in SYNC_POLICIES.items():
            model, _, _ = _sharded_model(shape, device)
            iterator = accumulation(model, batches[0][rank], policy)
            (tokens, targets), is_last = next(iterator)
            loss_sum, n_valid = token_loss_sum(model(tokens), targets)
            microbatch_loss(loss_sum, n_valid, 100).backward()
            out["reduced_after_first"][(shape, name)] = model.layers[0].attention.wq.weight.grad is not None
            for (tokens, targets), _ in iterator:  # finish the step so every rank leaves FSDP idle
                loss_sum, n_valid = token_loss_sum(model(tokens), targets)
                microbatch_loss(loss_sum, n_valid, 100).backward()
            flags = [(g.reduce_grads, g.all_reduce_grads) for u in model.modules()
                     if hasattr(u, "_get_fsdp_state") for g in u._get_fsdp_state()._fsdp_param_groups]
            out.setdefault("flags_after_loop", set()).update(flags)

    # One all-reduce of token counts, including a rank whose microbatches have none.
    local = [torch.full((2, 3), IGNORE_INDEX)] if rank == 3 else [torch.zeros(2, 3, dtype=torch.long)] * (rank + 1)
    out["tokens"] = count_global_tokens(sum(valid_targets(t) for t in local))

    # Clipping: total norm and clipped full gradients, per mesh.
    out["clip"] = {}
    for shape in SHAPES:
        model, mesh, pcfg = _sharded_model(shape, device)
        _step_grads(model, batches[0][rank], resolve_sync_policy(pcfg, mesh.dims, 3))
        norm = float(clip_grad_norm_(model, max_norm=0.05))
        clipped = {n: p.grad.full_tensor().double().numpy() for n, p in model.named_parameters()}
        out["clip"][shape] = (norm, clipped if rank == 0 else None)

    # HSDP 2x2: a few AdamW steps under the auto policy (delayed all-reduce); replicas agree.
    model, mesh, pcfg = _sharded_model((2, 2), device)
    policy = resolve_sync_policy(pcfg, mesh.dims, grad_accum=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    fixed = batches[0][rank]
    losses = []
    for _ in range(4):
        global_tokens = _step_grads(model, fixed, policy)
        clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            total = torch.tensor([sum(float(token_loss_sum(model(t), y)[0]) for t, y in fixed)])
        dist.all_reduce(total)
        losses.append(float(total) / global_tokens)
    out["hsdp_policy"] = policy.name
    out["hsdp_losses"] = losses
    model.reshard()  # the root keeps its parameters gathered after forward
    local_shards = torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(local_shards) for _ in range(world)]
    dist.all_gather(gathered, local_shards)
    # ranks 0 and 2 (and 1 and 3) hold the same shard in different replica groups
    out["replicas_equal"] = bool(torch.equal(gathered[0], gathered[2]) and torch.equal(gathered[1], gathered[3]))
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_on_ranks(_worker, 4, timeout=300)


def test_init_distributed_reuses_the_harness_group(ranks):
    assert [(r["rank"], r["world"], r["device"]) for r in ranks] == [(i, 4, "cpu") for i in range(4)]


def test_mesh_shapes_and_placements(ranks):
    layout = ranks[0]["layout"]
    wq_rows = MODEL_CFG.dim  # wq is [dim, dim]
    # (full mesh, mesh given to fully_shard, placements, local shard shape)
    assert layout[(1, 4)] == ((1, 4), (4,), ("Shard(dim=0)",), (wq_rows // 4, wq_rows))
    assert layout[(2, 2)] == ((2, 2), (2, 2), ("Replicate()", "Shard(dim=0)"), (wq_rows // 2, wq_rows))
    assert layout[(4, 1)] == ((4, 1), (4, 1), ("Replicate()", "Shard(dim=0)"), (wq_rows, wq_rows))
    assert layout[(2, -1)] == layout[(2, 2)]


def test_sync_flags_hold_back_reduction_until_the_last_microbatch(ranks):
    reduced = ranks[0]["reduced_after_first"]
    assert reduced[((1, 4), "every_microbatch")] and reduced[((2, 2), "every_microbatch")]
    # FSDP without replication has no all-reduce to delay: the reduce-scatter lands.
    assert reduced[((1, 4), "delayed_all_reduce")]
    assert not reduced[((2, 2), "delayed_all_reduce")]
    assert not reduced[((1, 4), "final_only")] and not reduced[((2, 2), "final_only")]
    # after the loop every unit is back to full synchronisation
    assert all(r["flags_after_loop"] == {(True, True)} for r in ranks)


def test_global_token_count_is_one_sum_over_ranks(ranks):
    assert [r["tokens"] for r in ranks] == [6 + 12 + 18] * 4


def test_clip_grad_norm_matches_single_process_reference(ranks):
    state, batches = initial_state(0), make_batches(0, n_steps=1)
    ref_grads, _, _ = reference_run(state, batches, "float64")
    ref_norm = float(torch.sqrt(sum((g * g).sum() for g in ref_grads.values())))
    scale = 0.05 / (ref_norm + 1e-6)
    assert scale < 1  # clipping really happens
    for shape in SHAPES:
        norms = [r["clip"][shape][0] for r in ranks]
        assert max(abs(n - ref_norm) for n in norms) <= 1e-5 * ref_norm, (shape, norms, ref_norm)
        clipped = ranks[0]["clip"][shape][1]
        err, name = relative_error(clipped, {n: g * scale for n, g in ref_grads.items()})
        assert err <= 1e-5, (shape, name, err)


def test_hsdp_2x2_training_steps(ranks):
    losses = ranks[0]["hsdp_losses"]
    assert ranks[0]["hsdp_policy"] == "delayed_all_reduce"
    assert all(r["hsdp_losses"] == losses for r in ranks)
    assert losses[-1] < losses[0]
    assert all(r["replicas_equal"] for r in ranks)


@pytest.mark.parametrize("replicate,shard,world", [(3, -1, 4), (2, 3, 4), (1, 3, 4), (4, 2, 4)])
def test_mesh_that_does_not_fit_the_world_is_a_one_line_config_error(replicate, shard, world):
    with pytest.raises(ConfigError) as err:
        JobMesh.from_config(ParallelConfig(dp_replicate=replicate, dp_shard=shard), world, "cpu")
    message = str(err.value)
    assert "\n" not in message and f"world size {world}" in message


_SINGLE_PROCESS = textwrap.dedent("""
    import json, torch
    import torch.distributed as dist
    from moetrain.config.parallel import ParallelConfig
    from moetrain.parallel.mesh import JobMesh, MeshDims
    from moetrain.parallel.process_group import init_distributed
    from moetrain.parallel.shard import apply_fsdp
    from moetrain.parallel.grad_sync import accumulation, count_global_tokens, resolve_sync_policy, clip_grad_norm_
    from moetrain.train.loss import token_loss_sum, microbatch_loss
    from moetrain.model.transformer import Transformer
    from parity_support import MODEL_CFG, initial_state, load_full_state, make_batches

    pcfg = ParallelConfig()
    rank, world, device = init_distributed(pcfg)
    mesh = JobMesh.from_config(pcfg, world, device)
    # FSDP on a one-rank group on purpose (the builder leaves one rank unwrapped): DTensor gradients.
    with torch.device("meta"):
        model = Transformer(MODEL_CFG)
    apply_fsdp(model, mesh, pcfg)
    model.to_empty(device=device)
    load_full_state(model, initial_state(0))
    plain = Transformer(MODEL_CFG)
    plain.load_state_dict(initial_state(0))
    mbs = make_batches(0, world=1, n_steps=1)[0][0]
    n = count_global_tokens(sum(int((t != -100).sum()) for _, t in mbs))
    for (tok, tgt), _ in accumulation(model, mbs, resolve_sync_policy(pcfg, mesh.dims, len(mbs))):
        s, v = token_loss_sum(model(tok), tgt)
        microbatch_loss(s, v, n, model.aux_loss()).backward()
    for tok, tgt in mbs:
        s, v = token_loss_sum(plain(tok), tgt)
        microbatch_loss(s, v, n, plain.aux_loss()).backward()
    ref = dict(plain.named_parameters())
    err = max(float((p.grad.full_tensor() - ref[k].grad).abs().max() / ref[k].grad.abs().max())
              for k, p in model.named_parameters())
    print(json.dumps({"rank": rank, "world": world, "backend": dist.get_backend(), "mesh": list(mesh.data.shape),
                      "tokens": n, "grad_err": err, "norm": float(clip_grad_norm_(model, 1e9))}))
""")


def test_single_process_without_launcher_env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(__file__), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run([sys.executable, "-c", _SINGLE_PROCESS], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert (result["rank"], result["world"], result["backend"], result["mesh"]) == (0, 1, "gloo", [1, 1])
    assert result["tokens"] > 0 and result["norm"] > 0
    assert result["grad_err"] <= 1e-5


def test_backend_follows_the_device_and_nccl_on_cpu_is_rejected():
    from moetrain.parallel.process_group import _backend_for, _device_type

    assert _backend_for("cpu", ParallelConfig()) == "gloo"
    assert _backend_for("cuda", ParallelConfig()) == "nccl"
    # an existing group decides the device: the gloo harness means CPU tensors even on a GPU machine
    assert _device_type(ParallelConfig(), "gloo") == "cpu" and _device_type(ParallelConfig(), "nccl") == "cuda"
    assert _device_type(ParallelConfig(backend="gloo"), None) == "cpu"
    with pytest.raises(ConfigError, match="parallel.backend = 'nccl'"):
        _backend_for("cpu", ParallelConfig(backend="nccl"))
