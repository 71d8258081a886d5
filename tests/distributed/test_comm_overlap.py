"""Communication overlap on 4 gloo ranks: the overlapped paths compute what the plain ones do, in overlapped order.

One 4-rank spawn:
- one MoE layer with a gated shared expert under EP=4 (uneven tokens, a rank without any): the pipelined
  path (2 token chunks, the shared expert beside the dispatches) against the plain one (1 chunk, the shared
  expert after the routed experts' combine, as without the overlap): output and the gradients
  of x and of every parameter within 1e-6 relative to the largest entry. Not bitwise: the chunks cut the
  expert GEMMs (and their weight-gradient sums) at other rows, so float32 rounding differs (measured below
  2e-7). Also the order the rank issued and waited the all-to-alls and ran the shared expert, forward and
  backward: with the overlap removed (a wait right after each launch, the shared expert after the waits),
  those checks fail;
- the parity-grid transformer (2 dense + 2 MoE blocks) under FSDP 4 with `parallel.fsdp_prefetch` 1 and 0:
  loss and every gradient bitwise equal (prefetching gathers the same bytes, only earlier), and with
  prefetch on the next unit's all-gather is pending while each unit computes (none without);
- the same transformer under EP 4: pipelined against one chunk, loss and gradients within 1e-6.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from parity_support import MODEL_CFG, initial_state, load_full_state, make_batches

from moetrain.config.moe import MoEConfig
from moetrain.config.parallel import ParallelConfig
from moetrain.data.packing import IGNORE_INDEX
from moetrain.model.moe import MoE
from moetrain.testing import run_on_ranks

BOUND = 1e-6
DIM, EXPERTS, TOKENS = 16, 8, (9, 6, 0, 7)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().cpu().numpy()


def _moe_layer() -> MoE:
    cfg = MoEConfig(n_experts=EXPERTS, top_k=2, expert_hidden=8, n_shared_experts=1, shared_expert_gate=True,
                    impl="memory_efficient")
    torch.manual_seed(0)
    moe = MoE(DIM, cfg)
    with torch.no_grad():
        for param in moe.parameters():
            param.copy_(torch.randn(param.shape) / param.shape[-1] ** 0.5)
    moe.reset_buffers()
    return moe


def _record_order(moe: MoE, events: list[str]):
    """Log every all-to-all issue and wait (expert_parallel's `_issue` / `_wait`) and the shared expert's
    forward and backward into `events`; returns the undo."""
    from moetrain.parallel import expert_parallel

    issue, wait = expert_parallel._issue, expert_parallel._wait

    def logged_issue(*args):
        events.append("issue")
        return issue(*args)

    def logged_wait(*args):
        events.append("wait")
        return wait(*args)

    expert_parallel._issue, expert_parallel._wait = logged_issue, logged_wait
    hooks = [moe.shared_expert.register_forward_pre_hook(lambda *_: events.append("shared")),
             moe.shared_expert.register_full_backward_hook(lambda *_: events.append("shared_backward"))]

    def undo():
        expert_parallel._issue, expert_parallel._wait = issue, wait
        for hook in hooks:
            hook.remove()
    return undo


def _moe_case(chunks: int, overlap_shared: bool, rank: int, world: int) -> dict:
    from moetrain.parallel.collectives import all_reduce_sum
    from moetrain.parallel.expert_parallel import apply_expert_parallel
    from moetrain.parallel.mesh import JobMesh

    moe = _moe_layer()
    ep_mesh = JobMesh.from_config(ParallelConfig(ep=world), world, "cpu").experts.ep
    apply_expert_parallel(moe, ep_mesh)
    moe.expert_compute.chunks = chunks
    if not overlap_shared:
        moe.expert_compute.runs_alongside = False  # the instance hides the class's: MoE runs it after
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(TOKENS[rank], DIM, generator=gen).requires_grad_()
    cotangent = torch.randn(x.shape, generator=gen)
    events: list[str] = []
    undo = _record_order(moe, events)
    try:
        out = moe(x)
        forward_events = len(events)
        (out * cotangent).sum().backward()
    finally:
        undo()
    grads = {}
    for name, param in moe.named_parameters():
        grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
        if name.startswith("experts."):  # local experts at their global offset, then summed over ranks
            full = torch.zeros((EXPERTS, *grad.shape[1:]))
            first = ep_mesh.get_local_rank() * grad.shape[0]
            full[first:first + grad.shape[0]] = grad
            grad = full
        grads[name] = _np(all_reduce_sum(grad.clone()))
    return {"out": _np(out), "grad_x": _np(x.grad), "grads": grads,
            "forward": events[:forward_events], "backward": events[forward_events:]}


def _model_case(ep: int, prefetch: int, chunks: int, batches, state, rank: int, world: int) -> dict:
    from moetrain.parallel.expert_parallel import moe_layers
    from moetrain.parallel.grad_sync import accumulation, count_global_tokens, resolve_sync_policy
    from moetrain.parallel.mesh import JobMesh
    from moetrain.parallel.shard import fsdp_modules
    from moetrain.train.build import build_model
    from moetrain.train.loss import microbatch_loss, token_loss_sum

    pcfg = ParallelConfig(ep=ep, fsdp_prefetch=prefetch)
    mesh = JobMesh.from_config(pcfg, world, "cpu")
    model = build_model(MODEL_CFG, pcfg, mesh, "cpu", weights="none")
    load_full_state(model, state)
    default_chunks = {moe.expert_compute.chunks for moe in moe_layers(model) if ep > 1}
    for moe in moe_layers(model):
        if ep > 1:
            moe.expert_compute.chunks = chunks
    # Whether the next block's all-gather is in flight (issued, not yet waited for) while each block computes.
    pending = []
    blocks = list(model.layers.values()) if hasattr(model.layers, "values") else list(model.layers)
    for block, following in zip(blocks, blocks[1:], strict=False):
        groups = following._get_fsdp_state()._fsdp_param_groups
        block.register_forward_hook(
            lambda *_, groups=groups: pending.append(any(g._all_gather_result is not None for g in groups)))
    microbatches = batches[0][rank]
    policy = resolve_sync_policy(pcfg, mesh.dims, len(microbatches))
    global_tokens = count_global_tokens(sum(int((t != IGNORE_INDEX).sum()) for _, t in microbatches))
    losses = []
    for (tokens, targets), _ in accumulation(model, microbatches, policy):
        loss_sum, n_valid = token_loss_sum(model(tokens), targets)
        loss = microbatch_loss(loss_sum, n_valid, global_tokens, model.aux_loss())
        loss.backward()
        losses.append(float(loss))
    grads = {name: _np(p.grad.full_tensor()) for name, p in model.named_parameters()}
    assert len(list(fsdp_modules(model))) > 1
    return {"losses": losses, "grads": grads, "pending": pending, "default_chunks": default_chunks}


MODEL_RUNS = {"fsdp_prefetch": (1, 1, 2), "fsdp_no_prefetch": (1, 0, 2), "ep4_chunks2": (4, 1, 2),
              "ep4_chunks1": (4, 1, 1)}


def _worker(batches, state) -> dict:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"moe": {name: _moe_case(chunks, shared, rank, world)
                   for name, chunks, shared in (("overlapped", 2, True), ("plain", 1, False))}}
    out["model"] = {name: _model_case(*run, batches, state, rank, world) for name, run in MODEL_RUNS.items()}
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_on_ranks(_worker, 4, make_batches(0), initial_state(0), timeout=300)


def _rel(actual, expected) -> float:
    expected = np.asarray(expected, dtype=np.float64)
    return float(np.abs(np.asarray(actual) - expected).max(initial=0.0) / max(np.abs(expected).max(initial=0.0), 1e-30))


def test_pipelined_moe_layer_matches_the_plain_path(ranks):
    for rank, result in enumerate(ranks):
        got, want = result["moe"]["overlapped"], result["moe"]["plain"]
        assert got["out"].shape == (TOKENS[rank], DIM)
        assert _rel(got["out"], want["out"]) <= BOUND
        assert _rel(got["grad_x"], want["grad_x"]) <= BOUND
        assert got["grads"].keys() == want["grads"].keys()
        for name in want["grads"]:
            assert np.abs(want["grads"][name]).max() > 0, name
            assert _rel(got["grads"][name], want["grads"][name]) <= BOUND, name


def test_dispatches_travel_while_the_shared_expert_and_the_other_chunk_compute(ranks):
    for result in ranks:
        forward, backward = result["moe"]["overlapped"]["forward"], result["moe"]["overlapped"]["backward"]
        # Both chunks' rows and scores issued, then the shared expert, then the first wait; chunk 0's combine
        # is issued before chunk 1's rows are waited for, and waited for after chunk 1's experts.
        assert forward == ["issue"] * 4 + ["shared"] + ["wait", "wait", "issue"] * 2 + ["wait", "wait"]
        # Backward: the combines' reverse all-to-alls are issued at once (chunk 0's travels while chunk 1's
        # experts run backward), the dispatches' reverse ones before the shared expert's backward and waited
        # for after it.
        shared = backward.index("shared_backward")
        assert backward[:3] == ["issue", "issue", "wait"]
        assert backward.count("issue") == 6 and backward[:shared].count("issue") == 6
        assert backward[shared + 1:] == ["wait"] * 4
        plain = result["moe"]["plain"]
        assert plain["forward"].index("shared") == len(plain["forward"]) - 1  # the plain path: after everything


def test_fsdp_prefetch_gathers_ahead_and_changes_no_bit(ranks):
    for result in ranks:
        on, off = result["model"]["fsdp_prefetch"], result["model"]["fsdp_no_prefetch"]
        assert on["losses"] == off["losses"]
        for name, grad in off["grads"].items():
            assert np.array_equal(on["grads"][name], grad), name
        assert on["pending"] and all(on["pending"])
        assert not any(off["pending"])


def test_gloo_expert_parallelism_runs_one_chunk_by_default(ranks):
    # gloo's transfers take the compute's own cores: nothing to hide behind, so the layer does not split.
    assert all(result["model"]["ep4_chunks2"]["default_chunks"] == {1} for result in ranks)


def test_pipelined_expert_parallel_model_matches_one_chunk(ranks):
    for result in ranks:
        got, want = result["model"]["ep4_chunks2"], result["model"]["ep4_chunks1"]
        assert np.allclose(got["losses"], want["losses"], rtol=BOUND, atol=0)
        for name, grad in want["grads"].items():
            assert _rel(got["grads"][name], grad) <= BOUND, name
