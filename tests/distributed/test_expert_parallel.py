"""Expert parallelism on 4 gloo ranks against single-process float64 references; checkpoints across ep and world.

One 4-rank spawn (module fixture) serves every multi-rank check:
- the tiny 2-dense + 2-MoE transformer of the parity grid with EP=2 (x 2 FSDP), EP=4 and EP=2 under
  HSDP 2x2 with the delayed all-reduce, 3 uneven microbatches per rank (one with no valid target),
  3 SGD steps: forward output, loss, aux losses and expert loads of every forward, every gathered
  gradient, and the parameters after the steps;
- one MoE layer with EP=2 and EP=4 on crafted routing: an expert no token chooses, one rank whose
  tokens all go to one expert (top-1), a rank with no token at all, and under EP=4 a rank that
  receives nothing; output, gradients, aux loss, loads and the aux-free bias update from global loads;
- the gradient-dtype guard on expert weights (bf16 parameters, fp32 reduce, an fp32 gradient on w1);
- `moetrain train` with EP=4 (metrics, a checkpoint), then resumed with EP=2 on the same ranks.
The pytest process then loads that EP=4 checkpoint in one process. All checks are float32 vs float64
(or the same-precision reference for bf16), bound 1e-5 relative to the largest reference entry.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from parity_support import (
    MODEL_CFG,
    N_MICRO,
    N_STEPS,
    initial_state,
    load_full_state,
    make_batches,
    reference_run,
    relative_error,
)
from torch.utils._python_dispatch import TorchDispatchMode

from moetrain.config.moe import MoEConfig
from moetrain.config.parallel import ParallelConfig
from moetrain.data.packing import IGNORE_INDEX
from moetrain.model.moe import MoE
from moetrain.model.transformer import Transformer
from moetrain.testing import run_on_ranks
from moetrain.train import run
from moetrain.train.build import build_model
from moetrain.train.loss import microbatch_loss, token_loss_sum
from stdlib_corpus import copy_stdlib_modules

BOUND = 1e-5
# (name, (dp_replicate, dp_shard), ep, sync policy)
MODEL_CASES = [("ep2", (1, 4), 2, "every_microbatch"), ("ep4", (1, 4), 4, "every_microbatch"),
               ("hsdp2x2_ep2", (2, 2), 2, "delayed_all_reduce")]
MOE_DIM, MOE_EXPERTS = 16, 4
CORPUS = ["bisect.py", "colorsys.py", "keyword.py", "this.py", "stat.py", "glob.py", "fnmatch.py", "struct.py"]


def _valid(targets: torch.Tensor) -> int:
    return int((targets != IGNORE_INDEX).sum())


def _np(t: torch.Tensor) -> np.ndarray:
    # numpy, not tensors: torch pickles tensors as shared-memory handles that die with the rank.
    return t.detach().double().cpu().numpy()


# ---- the whole model ------------------------------------------------------------------------------

class _DivisionsByOne(TorchDispatchMode):
    """Counts tensor divisions by the scalar 1 (work that changes nothing) in the ops it sees."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.div and len(args) > 1 and isinstance(args[1], (int, float)) \
                and args[1] == 1:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _model_case(state, batches, shape, ep, policy_name, rank, world, device, model_cfg=MODEL_CFG) -> dict:
    from moetrain.parallel.grad_sync import accumulation, count_global_tokens, resolve_sync_policy
    from moetrain.parallel.mesh import JobMesh

    pcfg = ParallelConfig(dp_replicate=shape[0], dp_shard=shape[1], ep=ep, sync_policy=policy_name)
    mesh = JobMesh.from_config(pcfg, world, device)
    model = build_model(model_cfg, pcfg, mesh, device, weights="none")
    load_full_state(model, state)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    policy = resolve_sync_policy(pcfg, mesh.dims, N_MICRO)
    # Count the replicate-dim all-reduces FSDP issues in each microbatch's backward.
    all_reduces = []
    original_all_reduce = dist.all_reduce

    def counting_all_reduce(*args, **kwargs):
        all_reduces[-1] += 1
        return original_all_reduce(*args, **kwargs)

    out: dict = {"forwards": [], "all_reduces": all_reduces, "divisions_by_one": 0}
    for step in range(len(batches)):
        microbatches = batches[step][rank]
        global_tokens = count_global_tokens(sum(_valid(t) for _, t in microbatches))
        for (tokens, targets), _is_last in accumulation(model, microbatches, policy):
            logits = model(tokens.to(device))
            loss_sum, n_valid = token_loss_sum(logits, targets.to(device))
            if step == 0:
                out["forwards"].append({
                    "logits": _np(logits), "loss_sum": float(loss_sum),
                    "aux": [float(m.aux_loss) for m in model.moe_layers()],
                    "load": [m.tokens_per_expert.tolist() for m in model.moe_layers()]})
            all_reduces.append(0)
            dist.all_reduce = counting_all_reduce
            try:
                with _DivisionsByOne() as divisions:
                    microbatch_loss(loss_sum, n_valid, global_tokens, model.aux_loss()).backward()
            finally:
                dist.all_reduce = original_all_reduce
            out["divisions_by_one"] += divisions.count
        if step == 0:
            out["grads"] = {n: _np(p.grad.full_tensor()) for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    out["params"] = {n: _np(p.full_tensor()) for n, p in model.named_parameters()}
    out["param_groups"] = sum(len(u._get_fsdp_state()._fsdp_param_groups) for u in model.modules()
                              if hasattr(u, "_get_fsdp_state"))
    expert_w1 = model.layers[model_cfg.n_dense_layers].moe.experts.w1
    out["expert_layout"] = (tuple(expert_w1.device_mesh.mesh_dim_names), tuple(expert_w1.to_local().shape),
                            tuple(repr(p) for p in expert_w1.placements))
    if rank != 0:  # the gathered tensors are the same everywhere; ship them once
        out.pop("grads"), out.pop("params")
    return out


# One expert per EP rank over 2 expert-FSDP ranks: FSDP cannot split a single expert on dim 0 evenly,
# so the experts are sharded on dim 1 (the other placement path of shard._expert_placement_fn).
DIM1_CFG = replace(MODEL_CFG, moe=replace(MODEL_CFG.moe, n_experts=2, top_k=1))


def _state_for(cfg, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic float32 weights for `cfg`, drawn like the parity grid's `initial_state`."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in Transformer(cfg).state_dict().items():
        if name.endswith("norm.weight"):
            state[name] = torch.ones_like(tensor)
        elif name.endswith("expert_bias") or name.endswith("load_since_update"):
            state[name] = torch.zeros_like(tensor)
        else:
            fan_in = tensor.shape[-2] if "experts.w" in name else tensor.shape[-1]
            state[name] = torch.randn(tensor.shape, generator=gen) / math.sqrt(fan_in)
    return state


def _reference_grads_step0(cfg, state, batches) -> dict[str, torch.Tensor]:
    """Float64, one process: the gradient of step 0's global objective."""
    model = Transformer(cfg)
    model.load_state_dict(state)
    model.double()
    global_tokens = sum(_valid(t) for microbatches in batches[0] for _, t in microbatches)
    for microbatches in batches[0]:
        for tokens, targets in microbatches:
            loss_sum, n_valid = token_loss_sum(model(tokens), targets)
            microbatch_loss(loss_sum, n_valid, global_tokens, model.aux_loss()).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _reference_forwards(state, batches) -> list[list[dict]]:
    """Float64, one process: every (rank, microbatch) forward of step 0 on the initial weights."""
    model = Transformer(MODEL_CFG)
    model.load_state_dict(state)
    model.double()
    forwards = []
    with torch.no_grad():
        for microbatches in batches[0]:
            per_rank = []
            for tokens, targets in microbatches:
                logits = model(tokens)
                per_rank.append({"logits": logits.numpy(), "loss_sum": float(token_loss_sum(logits, targets)[0]),
                                 "aux": [float(m.aux_loss) for m in model.moe_layers()],
                                 "load": [m.tokens_per_expert.tolist() for m in model.moe_layers()]})
            forwards.append(per_rank)
    return forwards


class _Fp32GradW1:
    """Wraps an MoE's expert computation so its w1 accumulates float32 gradients (`grad_dtype`), as a layer
    asking for fp32 accumulation would: next to bf16 w2 gradients, FSDP's reduce-scatter refuses the mix."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, x, routing, w1, w2, activation, impl):
        if w1.grad is None:  # torch only lets grad_dtype change while there is no gradient
            w1.grad_dtype = torch.float32
        return self.inner(x, routing, w1, w2, activation, impl)


def _guard_case(state, batches, guard: bool, rank, world, device) -> tuple[str | None, dict | None]:
    """EP=2 x 2 FSDP, bf16 parameters and fp32 reduce, 3 microbatches: (error or None, rank 0's gathered grads)."""
    from moetrain.parallel.grad_sync import accumulation, count_global_tokens, resolve_sync_policy
    from moetrain.parallel.mesh import JobMesh
    from moetrain.parallel.parallelize import apply_ep
    from moetrain.parallel.shard import apply_fsdp

    pcfg = ParallelConfig(ep=2, param_dtype="bfloat16", reduce_dtype="float32")
    mesh = JobMesh.from_config(pcfg, world, device)
    with torch.device("meta"):
        model = Transformer(MODEL_CFG)
    apply_ep(model, mesh, 2)
    for moe in model.moe_layers():
        moe.expert_compute = _Fp32GradW1(moe.expert_compute)
    apply_fsdp(model, mesh, pcfg, gradient_guard=guard)
    model.to_empty(device=device)
    load_full_state(model, state)
    microbatches = batches[0][rank]
    global_tokens = count_global_tokens(sum(_valid(t) for _, t in microbatches))
    try:
        for (tokens, targets), _ in accumulation(model, microbatches, resolve_sync_policy(pcfg, mesh.dims, N_MICRO)):
            loss_sum, n_valid = token_loss_sum(model(tokens), targets)
            microbatch_loss(loss_sum, n_valid, global_tokens, model.aux_loss()).backward()
    except (AssertionError, RuntimeError) as err:
        return f"{type(err).__name__}: {str(err).splitlines()[0]}", None
    grads = {n: _np(p.grad.full_tensor()) for n, p in model.named_parameters()}
    dtypes = {str(p.grad.dtype) for p in model.parameters()}
    return None, {"grads": grads, "dtypes": dtypes} if rank == 0 else None


# ---- one MoE layer, crafted routing ---------------------------------------------------------------

def _moe_state(top_k: int) -> tuple[MoEConfig, dict[str, torch.Tensor]]:
    cfg = MoEConfig(n_experts=MOE_EXPERTS, top_k=top_k, expert_hidden=8, load_balance="aux_free",
                    bias_update_rate=0.01, impl="memory_efficient")
    gen = torch.Generator().manual_seed(top_k)
    router_ED = torch.linalg.qr(torch.randn(MOE_DIM, MOE_EXPERTS, generator=gen))[0].t().contiguous()
    state = {"router.weight": router_ED,
             "experts.w1": torch.randn(MOE_EXPERTS, MOE_DIM, 16, generator=gen) / MOE_DIM ** 0.5,
             "experts.w2": torch.randn(MOE_EXPERTS, 8, MOE_DIM, generator=gen) / 8 ** 0.5,
             # Expert 3 is never chosen: the choice bias outweighs any score (scores are in (0, 1)).
             "expert_bias": torch.tensor([0.0, 0.0, 0.0, -10.0])}
    return cfg, state


def _moe_inputs(top_k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per rank: (x [T, d], output cotangent [T, d]).

    rank 1's tokens point along router row 0 (and 1): under top-1 every one chooses expert 0, under
    top-2 experts {0, 1}; rank 2 has no token at all; ranks 0 and 3 are random.
    """
    cfg, state = _moe_state(top_k)
    router_ED = state["router.weight"]
    gen = torch.Generator().manual_seed(10 + top_k)
    sizes = [6, 5, 0, 7]
    xs = [torch.randn(n, MOE_DIM, generator=gen) for n in sizes]
    lead = 3 * router_ED[0] + (3 * router_ED[1] if top_k == 2 else 0)
    xs[1] = lead + 0.1 * torch.randn(sizes[1], MOE_DIM, generator=gen)
    return [(x, torch.randn(x.shape, generator=gen)) for x in xs]


def _moe_loss(moe: MoE, out: torch.Tensor, cotangent: torch.Tensor) -> torch.Tensor:
    loss = (out * cotangent).sum()
    # A forward over no token has no balance loss (its mean router probability is 0/0).
    return loss + 0.1 * moe.aux_loss if out.shape[0] else loss


def _moe_case(ep: int, top_k: int, rank: int, world: int) -> dict:
    from moetrain.parallel.collectives import all_reduce_sum
    from moetrain.parallel.expert_parallel import apply_expert_parallel
    from moetrain.parallel.mesh import JobMesh

    cfg, state = _moe_state(top_k)
    moe = MoE(MOE_DIM, cfg)
    moe.load_state_dict(state, strict=False)
    mesh = JobMesh.from_config(ParallelConfig(ep=ep), world, "cpu")
    ep_mesh = mesh.experts.ep
    stats = apply_expert_parallel(moe, ep_mesh)
    x, cotangent = _moe_inputs(top_k)[rank]
    x = x.clone().requires_grad_()
    out = moe(x)
    _moe_loss(moe, out, cotangent).backward()
    # Sum every rank's gradient of each expert: place local experts at their global offset.
    grads = {"router.weight": all_reduce_sum(moe.router.weight.grad.clone())}
    for name in ("w1", "w2"):
        local = getattr(moe.experts, name).grad.to_local()
        full = torch.zeros((MOE_EXPERTS, *local.shape[1:]))
        first = ep_mesh.get_local_rank() * local.shape[0]
        full[first: first + local.shape[0]] = local
        grads[f"experts.{name}"] = all_reduce_sum(full)
    moe.update_expert_bias(all_reduce_sum)
    seconds, sent, received = stats.take()
    return {"out": _np(out), "grad_x": _np(x.grad), "grads": {k: _np(v) for k, v in grads.items()},
            "aux": float(moe.aux_loss.detach()) if x.shape[0] else None, "load": moe.tokens_per_expert.tolist(),
            "bias": moe.expert_bias.tolist(), "sent": sent, "received": received, "seconds": seconds}


def _moe_reference(top_k: int) -> dict:
    """Float64, one process, the per-expert loop: each rank's tokens as their own forward."""
    cfg, state = _moe_state(top_k)
    cfg = MoEConfig(**{**cfg.__dict__, "impl": "loop"})
    moe = MoE(MOE_DIM, cfg).double()
    moe.load_state_dict({k: v.double() if k != "expert_bias" else v for k, v in state.items()}, strict=False)
    outs, grad_xs, auxes, loads = [], [], [], []
    for x, cotangent in _moe_inputs(top_k):
        x = x.double().requires_grad_()
        out = moe(x)
        _moe_loss(moe, out, cotangent.double()).backward()
        outs.append(out.detach().numpy())
        grad_xs.append(x.grad.numpy())
        auxes.append(float(moe.aux_loss.detach()) if x.shape[0] else None)
        loads.append(moe.tokens_per_expert.tolist())
    moe.update_expert_bias()  # the loads of every forward, summed in one process
    grads = {n: p.grad.numpy() for n, p in moe.named_parameters()}
    return {"out": outs, "grad_x": grad_xs, "aux": auxes, "load": loads, "grads": grads,
            "bias": moe.expert_bias.tolist()}


# ---- the worker -----------------------------------------------------------------------------------

def _worker(state, batches, run_dir: str, corpus: str) -> dict:
    from moetrain.parallel.process_group import init_distributed

    rank, world, device = init_distributed(ParallelConfig())
    result: dict = {"model": {}, "moe": {}}
    for name, shape, ep, policy in MODEL_CASES:
        result["model"][name] = _model_case(state, batches, shape, ep, policy, rank, world, device)
    result["dim1"] = _model_case(_state_for(DIM1_CFG), batches[:1], (1, 4), 2, "every_microbatch", rank, world,
                                 device, DIM1_CFG)
    result["guard"] = {guard: _guard_case(state, batches, guard, rank, world, device) for guard in (False, True)}
    dist.barrier()
    for ep in (2, 4):
        for top_k in (2, 1):
            result["moe"][(ep, top_k)] = _moe_case(ep, top_k, rank, world)
    # A short EP=4 run with a checkpoint, then the same checkpoint resumed (evaluated) with EP=2.
    result["run_ep4"] = run.run(_job(run_dir, corpus, ep=4, steps=2))
    result["run_ep2"] = run.run(_job(run_dir, corpus, ep=2, steps=2, resume=True))
    return result


def _job_args(run_dir: str, corpus: str, ep: int, steps: int, resume: bool = False) -> list[str]:
    fields = {
        "model.dim": 32, "model.n_layers": 2, "model.n_heads": 2, "model.ffn_hidden": 64, "model.max_seq_len": 32,
        "model.moe.n_experts": 8, "model.moe.top_k": 2, "model.moe.expert_hidden": 16, "parallel.ep": ep,
        "data.source": "dir", "data.path": corpus, "data.glob": "*.py", "data.seq_len": 32,
        "data.heldout_fraction": 0.2, "train.steps": steps, "train.microbatch_size": 2, "train.grad_accum": 2,
        "train.warmup_steps": 1, "train.eval_every": 1, "train.eval_batches": 2, "train.sample_tokens": 0,
        "checkpoint.every": steps, "checkpoint.resume": resume, "logging.run_dir": run_dir,
        "logging.log_every": 1, "logging.progress_bar": False,
    }
    return [arg for key, value in fields.items() for arg in (f"--{key}", str(value))]


def _job(run_dir: str, corpus: str, ep: int, steps: int, resume: bool = False):
    from moetrain.config.job import parse_job_args

    return parse_job_args(_job_args(run_dir, corpus, ep, steps, resume))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    corpus = copy_stdlib_modules(tmp_path_factory.mktemp("corpus"), CORPUS)
    run_dir = tmp_path_factory.mktemp("ep_run") / "run"
    state, batches = initial_state(0), make_batches(0)
    results = run_on_ranks(_worker, 4, state, batches, str(run_dir), str(corpus), timeout=600)
    return {"results": results, "state": state, "batches": batches, "run_dir": run_dir, "corpus": str(corpus)}


@pytest.fixture(scope="module")
def model_reference(ranks):
    grads, params, min_gap = reference_run(ranks["state"], ranks["batches"], "float64")
    return {"grads": grads, "params": params, "min_gap": min_gap,
            "forwards": _reference_forwards(ranks["state"], ranks["batches"])}


def _rel(actual, expected) -> float:
    expected = np.asarray(expected, dtype=np.float64)
    return float(np.abs(np.asarray(actual) - expected).max() / max(np.abs(expected).max(), 1e-30))


@pytest.mark.parametrize("case", [c[0] for c in MODEL_CASES])
def test_forward_loss_aux_and_loads_match_one_process(ranks, model_reference, case):
    assert model_reference["min_gap"] > 1e-5  # fp32 rounding cannot flip a top-k choice
    for rank, result in enumerate(ranks["results"]):
        for got, want in zip(result["model"][case]["forwards"], model_reference["forwards"][rank], strict=True):
            assert _rel(got["logits"], want["logits"]) <= BOUND
            assert abs(got["loss_sum"] - want["loss_sum"]) <= BOUND * max(abs(want["loss_sum"]), 1.0)
            assert _rel(got["aux"], want["aux"]) <= BOUND
            assert got["load"] == want["load"]  # integer counts: identical routing


@pytest.mark.parametrize("case", [c[0] for c in MODEL_CASES])
def test_every_gradient_and_the_parameters_after_three_steps_match(ranks, model_reference, case):
    result = ranks["results"][0]["model"][case]
    err, name = relative_error(result["grads"], model_reference["grads"])
    assert err <= BOUND, f"{name}: {err:.2e}"
    state = ranks["state"]
    update = {n: model_reference["params"][n] - state[n].double() for n in model_reference["params"]}
    err, name = relative_error(result["params"], model_reference["params"], update)
    assert err <= 5e-5, f"{name}: {err:.2e}"  # the parity grid's bound for 3 steps (docs/parallel.md)


@pytest.mark.parametrize("case", ["ep2", "ep4"])
def test_gradient_reduction_never_divides_by_one(ranks, case):
    # With ep = dp_shard (ep4) the expert weights' FSDP group holds one rank; a divide factor of 1 set
    # on it made FSDP2 copy every expert gradient through a fresh `grad / 1.0` each microbatch.
    # (Under HSDP with one shard rank, hsdp2x2_ep2, FSDP2 still does: there the factor of 1 is what
    # keeps its replicate all-reduce a sum instead of a mean.)
    for result in ranks["results"]:
        assert result["model"][case]["divisions_by_one"] == 0


def test_expert_weights_live_on_the_ep_mesh_and_in_their_blocks_units(ranks):
    experts = MODEL_CFG.moe.n_experts
    for name, (replicate, shard), ep, _ in MODEL_CASES:
        result = ranks["results"][0]["model"][name]
        efsdp = shard // ep
        # sharded expert weight: mesh (efsdp, ep) [+ dp_replicate], local rows E / ep / efsdp
        dims = ("dp_replicate", "efsdp", "ep") if replicate > 1 else ("efsdp", "ep")
        assert result["expert_layout"][:2] == (dims, (experts // ep // efsdp, MODEL_CFG.dim, 2 * 16)), name
        # one FSDP parameter group per unit (4 blocks, embedding, head, root) + one per MoE block's experts
        assert result["param_groups"] == 7 + (MODEL_CFG.n_layers - MODEL_CFG.n_dense_layers), name


def test_a_single_local_expert_is_sharded_on_dim_1_and_its_gradients_match(ranks):
    result = ranks["results"][0]["dim1"]
    # 2 experts over EP = 2: one whole expert per EP rank, split on dim 1 (d = 32) over its 2 efsdp ranks
    assert result["expert_layout"] == (("efsdp", "ep"), (1, MODEL_CFG.dim // 2, 2 * 16),
                                       ("Shard(dim=1)", "Shard(dim=0)"))
    reference = _reference_grads_step0(DIM1_CFG, _state_for(DIM1_CFG), ranks["batches"])
    err, name = relative_error(result["grads"], reference)
    assert err <= BOUND, f"{name}: {err:.2e}"


def test_delayed_all_reduce_holds_back_expert_and_other_replicate_reductions(ranks):
    result = ranks["results"][0]["model"]["hsdp2x2_ep2"]
    groups = result["param_groups"]
    # per microbatch of each of the 3 steps: nothing before the last, then every group (experts too)
    assert result["all_reduces"] == [0, 0, groups] * N_STEPS


def test_gradient_dtype_guard_covers_expert_weights(ranks, model_reference):
    # Without the guard FSDP refuses the expert unit's mixed fp32 (w1) / bf16 (w2) gradients ...
    assert all("uniform gradient dtype" in (r["guard"][False][0] or "") for r in ranks["results"])
    # ... with it every gradient arrives in the reduce dtype and matches the float64 reference to bf16
    # accuracy (the bound of tests/distributed/test_grad_dtype.py: a few bf16 roundings, u = 2^-8).
    assert all(r["guard"][True][0] is None for r in ranks["results"])
    result = ranks["results"][0]["guard"][True][1]
    assert result["dtypes"] == {"torch.float32"}
    err, name = relative_error(result["grads"], model_reference["grads"])
    assert err <= 5e-2, f"{name}: {err:.2e}"


@pytest.mark.parametrize("ep,top_k", [(2, 2), (2, 1), (4, 2), (4, 1)])
def test_uneven_routing_matches_the_per_expert_loop(ranks, ep, top_k):
    reference = _moe_reference(top_k)
    results = [r["moe"][(ep, top_k)] for r in ranks["results"]]
    # the crafted routing happened: expert 3 got nothing, rank 1 went to expert 0 (and 1), rank 2 had no token
    assert all(load[3] == 0 for load in reference["load"])
    assert reference["load"][1][0] == 5 and sum(reference["load"][1]) == 5 * top_k and sum(reference["load"][2]) == 0
    for rank, result in enumerate(results):
        if reference["out"][rank].size:
            assert _rel(result["out"], reference["out"][rank]) <= BOUND
            assert _rel(result["grad_x"], reference["grad_x"][rank]) <= BOUND
            assert abs(result["aux"] - reference["aux"][rank]) <= BOUND * abs(reference["aux"][rank])
        else:
            assert result["out"].shape == (0, MOE_DIM) and result["aux"] is None
        assert result["load"] == reference["load"][rank]
        err, name = relative_error(result["grads"], {k: torch.as_tensor(v) for k, v in reference["grads"].items()})
        assert err <= BOUND, f"rank {rank} {name}: {err:.2e}"
        # aux-free balancing: the bias moves by the global loads, the same on every rank as in one process
        # (the update is +-rate by the sign of mean load - load; the bias is float32 here, float64 there)
        initial = _moe_state(top_k)[1]["expert_bias"].double().numpy()
        moved, expected_move = np.asarray(result["bias"]) - initial, np.asarray(reference["bias"]) - initial
        assert np.array_equal(np.sign(moved), np.sign(expected_move)) and np.abs(expected_move).min() > 0
        assert result["bias"] == pytest.approx(reference["bias"], rel=1e-6)
    if ep == 4:  # rank 3 owns only expert 3, which no token chose
        assert results[3]["received"] == 0
    # every row one rank sent to another was received by it; the all-to-alls were timed
    assert sum(r["sent"] for r in results) == sum(r["received"] for r in results) > 0
    assert all(r["seconds"] > 0 for r in results)


def test_train_with_ep_reports_all_to_all_time_and_rows(ranks):
    records = [json.loads(line) for line in (ranks["run_dir"] / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for record in train:
        assert len(record["all_to_all_s_per_rank"]) == 4 and min(record["all_to_all_s_per_rank"]) > 0
        sent, received = record["all_to_all_rows_sent_per_rank"], record["all_to_all_rows_received_per_rank"]
        assert sum(sent) == sum(received) > 0
        # at most every routed row leaves its rank: 1 MoE layer x 2 microbatches x 2 x 32 tokens x top-2
        assert max(sent) <= 2 * 2 * 32 * 2


def test_ep4_checkpoint_evaluates_the_same_at_ep2_and_in_one_process(ranks, tmp_path):
    run_dir = ranks["run_dir"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["heldout_loss"] for r in records if r["kind"] == "eval"
             and r["step"] in (1, 2)}
    ep4, ep2 = ranks["results"][0]["run_ep4"], ranks["results"][0]["run_ep2"]
    assert ep4["step"] == 2 and ep2["step"] == 2 and ep2["steps_this_run"] == 0  # EP=2 only loaded and evaluated
    # 1 process (no expert parallelism) loads the same checkpoint
    assert run.main(_job_args(str(run_dir), ranks["corpus"], ep=1, steps=2, resume=True)) == 0
    one = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert one["kind"] == "final" and one["steps_this_run"] == 0
    for loaded in (ep2["heldout_loss"], one["heldout_loss"]):
        assert math.isclose(loaded, ep4["heldout_loss"], rel_tol=1e-5)
        assert loaded == pytest.approx(evals[2], rel=1e-5)
    assert abs(evals[1] - evals[2]) > 1e-3  # the loaded weights are step 2's, not an earlier state
