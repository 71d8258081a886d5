"""Shared pieces of the tensor- and context-parallel parity tests (no tests here).

Packed rows whose documents cross every CP chunk boundary, a float64 single-process reference over the
whole global batch (it uses no moetrain.parallel code), and the rank worker that trains the same steps
on a mesh through `SequenceSplit`, the way the trainer does. Spawned ranks import this module by name.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.config.parallel import ParallelConfig
from moetrain.data.packing import IGNORE_INDEX, Batch
from moetrain.model.layers import positions_from_documents
from moetrain.model.transformer import Transformer
from moetrain.train.build import build_model
from moetrain.train.global_balance import prepare_global_balance
from moetrain.train.loss import microbatch_loss, token_loss_sum

SEQ = 16  # 2 x cp x tp chunks of 2 tokens at most, so documents of 3-7 tokens cross every boundary
N_MICRO = 2
N_STEPS = 2
LR = 0.5
BOUND = 1e-5

# Grouped-query attention, a shared expert, a dense and an MoE block, a vocabulary TP splits unevenly; the
# global-batch balance loss (the scope that stays exact when a microbatch's tokens are routed on several
# ranks) and the z-loss.
TINY_MOE = ModelConfig(
    vocab_size=47, dim=32, n_layers=2, n_dense_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=SEQ,
    attention="dense",
    moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, impl="memory_efficient", aux_loss_coef=0.01,
                  aux_loss_scope="global_batch", z_loss_coef=0.01, n_shared_experts=1),
)
# The attention options of the other families the split must hold: a sliding window on odd layers,
# attention sinks and biases (GPT-OSS); partial RoPE and per-head QK-norm (GLM-4.5).
MODELS = {
    "tiny_moe": TINY_MOE,
    "gpt_oss_like": replace(TINY_MOE, sliding_window=5, layer_types=["sliding_attention", "full_attention"],
                            attention_sinks=True, attention_bias="all"),
    "deepseek_like": replace(TINY_MOE, kv_lora_rank=16, q_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
                             v_head_dim=6, n_kv_heads=None),
    "glm_like": replace(TINY_MOE, partial_rotary_factor=0.5, rope_layout="half", qk_norm="per_head",
                        attention_bias="qkv"),
}


def packed_batch(gen: torch.Generator, batch: int, cfg: ModelConfig) -> Batch:
    """[batch, SEQ] rows of documents of 3-7 tokens (the last one cut), some targets masked."""
    ids = torch.empty(batch, SEQ, dtype=torch.long)
    for row in range(batch):
        position, doc = 0, 0
        while position < SEQ:
            length = int(torch.randint(3, 8, (1,), generator=gen))
            ids[row, position:position + length] = doc
            position, doc = position + length, doc + 1
    tokens = torch.randint(0, cfg.vocab_size, (batch, SEQ), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (batch, SEQ), generator=gen)
    targets = torch.where(torch.rand(batch, SEQ, generator=gen) < 0.7, targets, torch.full_like(targets, IGNORE_INDEX))
    return Batch(tokens, positions_from_documents(ids), ids, targets)


def make_batches(cfg: ModelConfig, data_ranks: int, seed: int = 0, steps: int = N_STEPS) -> list[list[list[Batch]]]:
    """[step][data rank][microbatch] packed microbatches of 1 or 2 rows."""
    gen = torch.Generator().manual_seed(seed)
    return [[[packed_batch(gen, 1 + (rank + micro) % 2, cfg) for micro in range(N_MICRO)]
             for rank in range(data_ranks)] for _ in range(steps)]


def initial_state(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic float32 weights, every one random (norms, biases, sinks too), independent of model.init."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in Transformer(cfg).state_dict().items():
        if name.endswith("expert_bias") or name.endswith("load_since_update"):
            state[name] = torch.zeros_like(tensor)
        elif name.endswith("norm.weight"):
            state[name] = 1 + 0.1 * torch.randn(tensor.shape, generator=gen)
        else:
            fan_in = tensor.shape[-2] if "experts.w" in name else tensor.shape[-1]
            state[name] = torch.randn(tensor.shape, generator=gen) / math.sqrt(fan_in)
    return state


def _valid(batches: list[Batch]) -> int:
    return sum(b.n_valid_targets for b in batches)


def reference_step(model: Transformer, microbatches: list[Batch]) -> float:
    """One process's forwards and backwards over a step's whole global batch; the step's mean loss."""
    global_tokens = _valid(microbatches)
    prepare_global_balance(model, microbatches)
    loss_total = 0.0
    for mb in microbatches:
        logits = model(mb.tokens, positions=mb.positions, document_ids=mb.document_ids)
        loss_sum, n_valid = token_loss_sum(logits, mb.targets)
        z = model.z_loss_sum(mb.targets != IGNORE_INDEX)
        microbatch_loss(loss_sum, n_valid, global_tokens, model.aux_loss(), z, aux_is_share=True).backward()
        loss_total += float(loss_sum.detach())
    return loss_total / global_tokens


def split_step(model, split, policy, microbatches: list[Batch]) -> float:
    """A rank's forwards and backwards over its data rank's `microbatches` through `split` (SequenceSplit), the way
    the trainer runs them; the step's mean loss over the whole global batch."""
    import torch.distributed as dist

    from moetrain.parallel.grad_sync import accumulation, count_global_tokens

    global_tokens = count_global_tokens(_valid(microbatches)) // split.replicas
    prepare_global_balance(model, microbatches, split.model_inputs, split.tp)
    loss_total = torch.zeros((), dtype=torch.float64)
    for mb, _is_last in accumulation(model, microbatches, policy):
        logits = model(**split.model_inputs(mb))
        with split.loss_context():
            loss_sum, n_valid = token_loss_sum(logits, split.shard(mb.targets))
            loss_sum = split.local_loss(loss_sum)
            z = model.z_loss_sum(split.routed_mask(mb.targets != IGNORE_INDEX))
            microbatch_loss(loss_sum, n_valid, global_tokens, model.aux_loss(), z, aux_is_share=True).backward()
        loss_total += loss_sum.detach().double() / split.tp  # every TP rank holds the whole loss
    dist.all_reduce(loss_total)
    return float(loss_total) / global_tokens


def reference_run(cfg: ModelConfig, state, batches) -> dict:
    """One float64 process over each step's whole global batch: losses, step-0 grads, final params."""
    model = Transformer(cfg)
    model.load_state_dict(state)
    model.double().train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    out: dict = {"losses": []}
    for step, ranks in enumerate(batches):
        out["losses"].append(reference_step(model, [mb for rank in ranks for mb in rank]))
        if step == 0:
            out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def load_full_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy full float32 weights into a possibly TP/FSDP/EP-sharded model, rank-locally."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        for name, param in model.named_parameters():
            full = state[name].to(param.dtype)
            if isinstance(param, DTensor):
                param.to_local().copy_(distribute_tensor(full, param.device_mesh, param.placements,
                                                         src_data_rank=None).to_local())
            else:
                param.copy_(full)
        for name, buffer in model.named_buffers():
            buffer.copy_(state[name].to(buffer.dtype)) if name in state else buffer.zero_()


def split_worker(cases: list[tuple[str, dict]], states: dict, batches_by_case: dict) -> list | None:
    """On every rank: each (model name, parallel fields) case for N_STEPS SGD steps; rank 0 returns the results."""
    import torch.distributed as dist

    from moetrain.parallel.context_parallel import SequenceSplit
    from moetrain.parallel.grad_sync import resolve_sync_policy
    from moetrain.parallel.mesh import JobMesh
    from moetrain.parallel.process_group import init_distributed

    rank, world, device = init_distributed(ParallelConfig())
    states = {model: {n: torch.from_numpy(t) for n, t in state.items()} for model, state in states.items()}
    batches_by_case = {key: [[[Batch(*(torch.from_numpy(t) for t in mb)) for mb in rank] for rank in step]
                             for step in steps] for key, steps in batches_by_case.items()}
    results = []
    for model_name, fields in cases:
        cfg = MODELS[model_name]
        pcfg = ParallelConfig(**fields)
        mesh = JobMesh.from_config(pcfg, world, device)
        model = build_model(cfg, pcfg, mesh, device, weights="none")
        load_full_state(model, states[model_name])
        model.train()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        policy = resolve_sync_policy(pcfg, mesh.dims, N_MICRO)
        split = SequenceSplit.of(mesh)
        losses = []
        for step, ranks in enumerate(batches_by_case[(model_name, tuple(sorted(fields.items())))]):
            losses.append(split_step(model, split, policy, ranks[mesh.data_rank]))
            if step == 0:
                missing = [n for n, p in model.named_parameters() if p.grad is None]
                assert not missing, missing
                grads = {n: p.grad.full_tensor().double().numpy() for n, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad()
        params = {n: p.full_tensor().detach().double().numpy() for n, p in model.named_parameters()}
        if rank == 0:  # numpy: torch pickles tensors as shared-memory handles that die with the rank
            results.append({"losses": losses, "grads": grads, "params": params})
        dist.barrier()
    return results if rank == 0 else None


def run_cases(cases: dict[str, tuple[str, dict]], world: int = 4) -> dict[str, tuple[dict, dict]]:
    """{case: (result on the ranks, float64 reference)} for {case: (model name, parallel fields)}."""
    from moetrain.testing import run_on_ranks

    states = {model: initial_state(MODELS[model]) for model, _ in cases.values()}
    batches, references = {}, {}
    for model, fields in cases.values():
        key = (model, tuple(sorted(fields.items())))
        batches[key] = make_batches(MODELS[model], world // (fields.get("tp", 1) * fields.get("cp", 1)))
        references[key] = reference_run(MODELS[model], states[model], batches[key])
    # numpy, not tensors, to the ranks: the fork server passes each tensor as a file descriptor.
    states_np = {model: {n: t.numpy() for n, t in state.items()} for model, state in states.items()}
    batches_np = {key: [[[tuple(t.numpy() for t in (mb.tokens, mb.positions, mb.document_ids, mb.targets))
                          for mb in rank] for rank in step] for step in steps] for key, steps in batches.items()}
    results = run_on_ranks(split_worker, world, list(cases.values()), states_np, batches_np, timeout=600)[0]
    return {name: (result, references[(model, tuple(sorted(fields.items())))])
            for (name, (model, fields)), result in zip(cases.items(), results, strict=True)}


def check_case(result: dict, reference: dict) -> None:
    """Losses of every step, step-0 gradients and the final parameters within BOUND of the reference."""
    losses = max(abs(a - b) / abs(b) for a, b in zip(result["losses"], reference["losses"], strict=True))
    assert losses < BOUND, losses
    for what in ("grads", "params"):
        error, name = relative_error(result[what], reference[what])
        assert error < BOUND, (what, name, error)


def relative_error(actual: dict, expected: dict[str, torch.Tensor]) -> tuple[float, str]:
    """max over tensors of max|actual - expected| / max|expected|, and the worst tensor's name."""
    worst, worst_name = 0.0, ""
    for name, exp in expected.items():
        err = float((torch.as_tensor(actual[name]) - exp).abs().max()) / max(float(exp.abs().max()), 1e-30)
        if err > worst:
            worst, worst_name = err, name
    return worst, worst_name
