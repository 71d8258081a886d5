"""LoRA under tensor and context parallelism on gloo ranks against one float64 process.

The split parity models (split_parity_support: grouped-query attention, a shared expert, a dense and an MoE
block; and the DeepSeek-V3-shaped one, whose MLA low-rank projections stay whole under TP) with adapters on
every target (attention, dense feed-forward, shared expert, per-expert routed adapters, router), each adapter
random (B too, so every gradient is non-zero). Each mesh trains one AdamW step on the adapters the way the
trainer does (`SequenceSplit`: the vocabulary-parallel loss, token counts once per TP/CP group, the
global-batch balance loss, the z-loss). The gathered step-0 adapter gradients must equal the float64
process's over the whole global batch to 1e-5 relative, the base must take no gradient, and after the step
the frozen base (split by TP, FSDP and over the experts' mesh) must be bitwise what it was.
Without the plan keeping frozen parameters frozen, the norms and router take gradients (base check fails).
torch's own Colwise/RowwiseParallel on an adapted linear (lora_A split on its rank, a row-wise A left whole)
give the same gradients, DTensor redistributing, but move activations around every adapter: the collective
count test fails on them (33 all-gathers and 25 reduce-scatters against 10 and 8 without adapters).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from split_parity_support import MODELS, N_MICRO, initial_state, load_full_state, make_batches, relative_error

from moetrain.config.lora import LoraConfig
from moetrain.data.packing import IGNORE_INDEX, Batch
from moetrain.model.lora import adapter_parameters, apply_lora
from moetrain.model.transformer import Transformer
from moetrain.testing import run_on_ranks
from moetrain.train.global_balance import prepare_global_balance
from moetrain.train.loss import microbatch_loss, token_loss_sum

BOUND = 1e-5
LORA = LoraConfig(rank=2, alpha=3.0, targets=["attention", "ffn", "shared_experts", "experts", "router"])

# (model, parallel fields) on 4 ranks: FSDP 2 x TP 2 (MLA too), FSDP 2 x CP 2. TP 2 x CP 2 passed too (3.6e-6,
# docs/results.md round 21); left out of the suite for its time.
CASES = [("tiny_moe", {"tp": 2}), ("deepseek_like", {"tp": 2}), ("tiny_moe", {"cp": 2})]
COUNTED = 0  # the case whose activation collectives are counted (building two more models costs time)
WORLD = 4


def lora_state(model_name: str) -> dict[str, torch.Tensor]:
    """The split parity base weights and random adapters, all float32."""
    model = Transformer(MODELS[model_name])
    apply_lora(model, LORA)
    base, gen = initial_state(MODELS[model_name]), torch.Generator().manual_seed(11)
    return {name: (0.3 * torch.randn(t.shape, generator=gen) if ".lora_" in name else base[name]).float()
            for name, t in model.state_dict().items()}


def _objective(model, mb: Batch, global_tokens: int, split=None) -> torch.Tensor:
    """The trainer's microbatch loss (one process: `split` None), inside the vocabulary-parallel context."""
    inputs = split.model_inputs(mb) if split else {"tokens": mb.tokens, "positions": mb.positions,
                                                   "document_ids": mb.document_ids}
    logits = model(**inputs)
    targets = split.shard(mb.targets) if split else mb.targets
    loss_sum, n_valid = token_loss_sum(logits, targets)
    loss_sum = split.local_loss(loss_sum) if split else loss_sum
    routed = targets != IGNORE_INDEX if split is None else split.routed_mask(mb.targets != IGNORE_INDEX)
    return microbatch_loss(loss_sum, n_valid, global_tokens, model.aux_loss(), model.z_loss_sum(routed),
                           aux_is_share=True)


def reference_grads(model_name: str, state, batches) -> dict[str, torch.Tensor]:
    """Step 0's adapter gradients in one float64 process over the whole global batch."""
    model = Transformer(MODELS[model_name])
    apply_lora(model, LORA)
    model.load_state_dict(state)
    model.double().train()
    microbatches = [mb for rank in batches[0] for mb in rank]
    global_tokens = sum(mb.n_valid_targets for mb in microbatches)
    prepare_global_balance(model, microbatches)
    for mb in microbatches:
        _objective(model, mb, global_tokens).backward()
    return {name: p.grad.detach().clone() for name, p in adapter_parameters(model).items()}


def activation_collectives(model_name: str, pcfg, mesh, mb: Batch) -> dict[str, tuple[int, int]]:
    """{"lora", "base"}: (all-gathers, reduce-scatters) one microbatch's forward and backward issue, with adapters on
    every target and without: the adapter path must add none (its gradients' sums are all-reduces of [r, in] or
    [out, r]); torch's own styles, which split lora_A's rank, issue one more pair per adapted layer."""
    from torch.distributed.tensor.debug import CommDebugMode

    from moetrain.parallel.context_parallel import SequenceSplit
    from moetrain.train.build import build_model

    counts = {}
    for what, lora in (("lora", LORA), ("base", None)):
        model = build_model(MODELS[model_name], pcfg, mesh, mesh.device, weights="init", lora=lora)
        split = SequenceSplit.of(mesh)
        prepare_global_balance(model, [mb], split.model_inputs, split.tp)
        with CommDebugMode() as comm, split.loss_context():
            _objective(model, mb, mb.n_valid_targets, split).backward()
        kinds = {str(op): n for op, n in comm.get_comm_counts().items()}
        counts[what] = tuple(sum(n for op, n in kinds.items() if kind in op)
                             for kind in ("all_gather", "reduce_scatter"))
    return counts


def worker(cases, states, batches_by_case) -> list | None:
    """On every rank: each case built with adapters, AdamW steps on them; rank 0 returns what it checks."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from moetrain.config.parallel import ParallelConfig
    from moetrain.parallel.context_parallel import SequenceSplit
    from moetrain.parallel.grad_sync import accumulation, count_global_tokens, resolve_sync_policy
    from moetrain.parallel.mesh import JobMesh
    from moetrain.parallel.process_group import init_distributed
    from moetrain.train.build import build_model

    def full(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().numpy().copy()

    rank, world, device = init_distributed(ParallelConfig())
    results = []
    for index, ((model_name, fields), steps) in enumerate(zip(cases, batches_by_case, strict=True)):
        pcfg = ParallelConfig(**fields)
        mesh = JobMesh.from_config(pcfg, world, device)
        model = build_model(MODELS[model_name], pcfg, mesh, device, weights="none", lora=LORA)
        load_full_state(model, {n: torch.from_numpy(t) for n, t in states[model_name].items()})
        model.train()
        adapters = adapter_parameters(model)
        optimizer = torch.optim.AdamW(adapters.values(), lr=1e-2)
        policy, split = resolve_sync_policy(pcfg, mesh.dims, N_MICRO), SequenceSplit.of(mesh)
        for step, ranks in enumerate(steps):
            microbatches = [Batch(*(torch.from_numpy(t) for t in mb)) for mb in ranks[mesh.data_rank]]
            global_tokens = count_global_tokens(sum(mb.n_valid_targets for mb in microbatches)) // split.replicas
            prepare_global_balance(model, microbatches, split.model_inputs, split.tp)
            for mb, _is_last in accumulation(model, microbatches, policy):
                with split.loss_context():
                    _objective(model, mb, global_tokens, split).backward()
            if step == 0:
                grads = {name: full(p.grad) for name, p in adapters.items()}
                base_grads = [n for n, p in model.named_parameters() if n not in adapters and p.grad is not None]
            optimizer.step()
            optimizer.zero_grad()
        base = {n: full(p) for n, p in model.named_parameters() if n not in adapters}
        collectives = activation_collectives(model_name, pcfg, mesh, microbatches[0]) if index == COUNTED else None
        if rank == 0:  # numpy: torch pickles tensors as shared-memory handles that die with the rank
            results.append({"grads": grads, "base_grads": base_grads, "base": base, "collectives": collectives})
        dist.barrier()
    return results if rank == 0 else None


def _case_id(model_name: str, fields: dict) -> str:
    return f"{model_name}-" + "-".join(f"{k}{v}" for k, v in fields.items())


@pytest.fixture(scope="module")
def results() -> dict[str, tuple[dict, dict, dict]]:
    """{case id: (rank 0's result, reference gradients, the initial state)} for every case, one 4-rank run."""
    states = {name: lora_state(name) for name in {model for model, _ in CASES}}
    states_np = {name: {n: t.numpy() for n, t in state.items()} for name, state in states.items()}
    batches = [make_batches(MODELS[model], WORLD // (fields.get("tp", 1) * fields.get("cp", 1)), seed=3)[:1]
               for model, fields in CASES]  # one step: its gradients, then one AdamW step the base must survive
    batches_np = [[[[tuple(t.numpy() for t in (mb.tokens, mb.positions, mb.document_ids, mb.targets))
                     for mb in rank] for rank in step] for step in steps] for steps in batches]
    ranks = run_on_ranks(worker, WORLD, CASES, states_np, batches_np, timeout=600)[0]
    return {_case_id(model, fields): (result, reference_grads(model, states[model], steps), states[model])
            for (model, fields), steps, result in zip(CASES, batches, ranks, strict=True)}


@pytest.mark.parametrize("case", [_case_id(m, f) for m, f in CASES])
def test_adapter_gradients_under_tp_and_cp_equal_float64_and_the_base_stays_unchanged(results, case):
    result, want, state = results[case]
    assert set(result["grads"]) == set(want) and result["base_grads"] == []
    got = {name: torch.from_numpy(g).double() for name, g in result["grads"].items()}
    error, where = relative_error(got, want)
    print(f"{case}: {len(got)} adapter gradients, max relative error {error:.2e} at {where}")
    assert error < BOUND, (error, where)
    assert all(float(w.abs().max()) > 0 for w in want.values())  # every adapter takes a gradient
    for name, value in result["base"].items():
        assert np.array_equal(value, state[name].numpy()), name


def test_tensor_parallel_adapters_add_no_activation_collective(results):
    case = _case_id(*CASES[COUNTED])
    counts = results[case][0]["collectives"]
    print(f"{case}: (all-gathers, reduce-scatters) with adapters {counts['lora']}, without {counts['base']}")
    assert all(lora <= base for lora, base in zip(counts["lora"], counts["base"], strict=True)), counts
