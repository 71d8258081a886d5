"""Shared pieces of the parallel parity tests (no tests here): tiny MoE config, uneven data, references, workers.

Spawned ranks import this module by name, so it holds only module-level functions.
The single-process references share no code with moetrain.parallel.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.func import functional_call

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.config.parallel import ParallelConfig
from moetrain.data.loader import DataLoader
from moetrain.data.packing import IGNORE_INDEX
from moetrain.model.transformer import Transformer
from moetrain.train.build import build_model
from moetrain.train.loss import microbatch_loss, token_loss_sum

WORLD = 4
N_MICRO = 3
N_STEPS = 3
LR = 0.5
MOMENTUM = 0.9

# 2 dense + 2 MoE blocks, every dimension small; the memory-efficient expert path.
MODEL_CFG = ModelConfig(
    vocab_size=48, dim=32, n_layers=4, n_dense_layers=2, n_heads=4, ffn_hidden=48, max_seq_len=16,
    moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=16, impl="memory_efficient", aux_loss_coef=0.01),
)

PRECISIONS: dict[str, tuple[str, str]] = {
    "fp32": ("float32", "float32"),
    "bf16_params_fp32_reduce": ("bfloat16", "float32"),
    "bf16_bf16": ("bfloat16", "bfloat16"),
}

Batch = list[list[list[tuple[torch.Tensor, torch.Tensor]]]]  # [step][rank][microbatch] -> (tokens, targets)


def make_batches(seed: int = 0, world: int = WORLD, n_micro: int = N_MICRO, n_steps: int = N_STEPS) -> Batch:
    """Uneven microbatches: batch size, sequence length and masked fraction differ per rank and microbatch.

    Step 0, rank 1, microbatch 1 has no valid target at all.
    """
    gen = torch.Generator().manual_seed(seed)
    steps: Batch = []
    for step in range(n_steps):
        ranks = []
        for rank in range(world):
            microbatches = []
            for micro in range(n_micro):
                batch = int(torch.randint(1, 4, (1,), generator=gen))
                seq = int(torch.randint(4, 9, (1,), generator=gen))
                tokens = torch.randint(0, MODEL_CFG.vocab_size, (batch, seq), generator=gen)
                targets = torch.randint(0, MODEL_CFG.vocab_size, (batch, seq), generator=gen)
                keep = torch.rand(batch, seq, generator=gen) < (0.3 + 0.2 * ((rank + micro) % 4))
                targets = torch.where(keep, targets, torch.full_like(targets, IGNORE_INDEX))
                if (step, rank, micro) == (0, 1, 1):
                    targets.fill_(IGNORE_INDEX)
                microbatches.append((tokens, targets))
            ranks.append(microbatches)
        steps.append(ranks)
    return steps


def initial_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic float32 weights (our own simple init, independent of moetrain.model.init)."""
    model = Transformer(MODEL_CFG)
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("norm.weight"):
            value = torch.ones_like(tensor)
        elif name.endswith("expert_bias") or name.endswith("load_since_update"):
            value = torch.zeros_like(tensor)
        elif "tok_embeddings" in name:
            value = torch.randn(tensor.shape, generator=gen)
        else:
            fan_in = tensor.shape[-2] if "experts.w" in name else tensor.shape[-1]
            value = torch.randn(tensor.shape, generator=gen) / math.sqrt(fan_in)
        state[name] = value.float()
    return state


def _valid(microbatches) -> int:
    return sum(int((t != IGNORE_INDEX).sum()) for _, t in microbatches)


def reference_run(state: dict[str, torch.Tensor], batches: Batch, precision: str):
    """Single process, whole global batch: (grads after step 0, params after all steps, min top-k gap).

    precision="float64": everything in float64. A PRECISIONS key with bf16 params: float32
    master weights; every chunk runs forward/backward on fresh bf16 leaf copies whose
    gradients autograd delivers in the reduce dtype (as FSDP's param_dtype plus moetrain's
    gradient-dtype guard do), and the copies' gradients are summed into the float32
    masters. Each (rank, microbatch) chunk is a separate forward, exactly the chunks the
    ranks see: the MoE aux loss is a per-forward quantity, so the objective is
    Σ_chunks (token_loss_sum + n_valid · aux) / N_global for the reference and moetrain alike.
    """
    model = Transformer(MODEL_CFG)
    model.load_state_dict(state)
    install_router_probe(model)
    low_precision = precision != "float64" and PRECISIONS[precision][0] == "bfloat16"
    if not low_precision:
        model.double()
    grad_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[PRECISIONS.get(precision, ("", "float32"))[1]]
    params = dict(model.named_parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    grads0: dict[str, torch.Tensor] = {}
    min_gap = math.inf
    for step, ranks in enumerate(batches):
        global_tokens = sum(_valid(mbs) for mbs in ranks)
        for microbatches in ranks:
            for tokens, targets in microbatches:
                copies = {}
                if low_precision:
                    for name, param in params.items():
                        copies[name] = param.detach().to(torch.bfloat16).requires_grad_()
                        copies[name].grad_dtype = grad_dtype
                    logits = functional_call(model, copies, (tokens,))
                else:
                    logits = model(tokens)
                for moe in model.moe_layers():
                    min_gap = min(min_gap, _topk_gap(moe))
                loss_sum, n_valid = token_loss_sum(logits, targets)
                microbatch_loss(loss_sum, n_valid, global_tokens, model.aux_loss()).backward()
                for name, copy in copies.items():
                    grad = copy.grad.float()
                    params[name].grad = grad if params[name].grad is None else params[name].grad + grad
        if step == 0:
            grads0 = {n: p.grad.double().clone() for n, p in params.items()}
        optimizer.step()
        optimizer.zero_grad()
    return grads0, {n: p.detach().double().clone() for n, p in params.items()}, min_gap


def _topk_gap(moe) -> float:
    """Smallest gap between the k-th and (k+1)-th router score of the MoE's last forward."""
    top = moe._parity_last_probs.topk(moe.cfg.top_k + 1, dim=-1).values
    return float((top[:, -2] - top[:, -1]).min())


def install_router_probe(model: Transformer) -> None:
    """Record each MoE router's last scores (for the routing-margin precondition)."""
    for moe in model.moe_layers():
        def hook(module, args, output, moe=moe):
            moe._parity_last_probs = output.detach().float().softmax(dim=-1)
        moe.router.register_forward_hook(hook)


def load_full_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy a full (unsharded) state into a possibly FSDP-sharded model, rank-locally (no comms)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            full = state[name].to(param.dtype)
            if isinstance(param, DTensor):
                shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(shard.to_local())
            else:
                param.copy_(full)
        for name, buffer in model.named_buffers():
            # Non-persistent buffers (per-step expert loads) are not in a state dict: they start at 0.
            buffer.copy_(state[name].to(buffer.dtype)) if name in state else buffer.zero_()


def parallel_cfg(shape: tuple[int, int], policy: str, precision: str) -> ParallelConfig:
    param_dtype, reduce_dtype = PRECISIONS[precision]
    return ParallelConfig(dp_replicate=shape[0], dp_shard=shape[1], sync_policy=policy,  # type: ignore[arg-type]
                          param_dtype=param_dtype, reduce_dtype=reduce_dtype)  # type: ignore[arg-type]


def grid_worker(state, batches: Batch, cases: list[tuple[tuple[int, int], str, str]]):
    """On every rank: run each case for N_STEPS steps; rank 0 returns gathered grads/params per case."""
    import torch.distributed as dist

    from moetrain.parallel.grad_sync import accumulation, count_global_tokens, resolve_sync_policy
    from moetrain.parallel.mesh import JobMesh
    from moetrain.parallel.process_group import init_distributed

    rank, world, device = init_distributed(ParallelConfig())
    meshes = {}
    results = []
    for shape, policy_name, precision in cases:
        pcfg = parallel_cfg(shape, policy_name, precision)
        if shape not in meshes:
            meshes[shape] = JobMesh.from_config(pcfg, world, device)
        mesh = meshes[shape]
        model = build_model(MODEL_CFG, pcfg, mesh, device, weights="none")
        load_full_state(model, state)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        policy = resolve_sync_policy(pcfg, mesh.dims, N_MICRO)
        grads0 = {}
        for step in range(len(batches)):
            microbatches = batches[step][rank]
            global_tokens = count_global_tokens(sum(int((t != IGNORE_INDEX).sum()) for _, t in microbatches))
            for (tokens, targets), _is_last in accumulation(model, microbatches, policy):
                logits = model(tokens.to(device))
                loss_sum, n_valid = token_loss_sum(logits, targets.to(device))
                microbatch_loss(loss_sum, n_valid, global_tokens, model.aux_loss()).backward()
            if step == 0:
                grads0 = {n: p.grad.full_tensor().double() for n, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad()
        params = {n: p.full_tensor().detach().double() for n, p in model.named_parameters()}
        if rank == 0:
            # numpy, not tensors: torch pickles tensors as shared-memory handles that die with the rank.
            results.append(((shape, policy_name, precision), _to_numpy(grads0), _to_numpy(params)))
        dist.barrier()
    return results if rank == 0 else None


def _to_numpy(tensors: dict[str, torch.Tensor]) -> dict:
    return {name: t.cpu().numpy() for name, t in tensors.items()}


def relative_error(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                   scale: dict[str, torch.Tensor] | None = None) -> tuple[float, str]:
    """max over tensors of max|actual - expected| / max|scale| (scale defaults to expected)."""
    worst, worst_name = 0.0, ""
    for name, exp in expected.items():
        ref = exp if scale is None else scale[name]
        denom = max(float(ref.abs().max()), 1e-30)
        err = float((torch.as_tensor(actual[name]) - exp).abs().max()) / denom
        if err > worst:
            worst, worst_name = err, name
    return worst, worst_name


# Token-budget microbatches on HSDP 2x2 against one float64 process (test_token_budget_parity.py,
# test_chat_parity.py): the two differ only in their data and in what they count per microbatch.

def _step_loss(model, microbatches, global_tokens: int):
    for batch in microbatches:
        logits = model(batch.tokens, positions=batch.positions, document_ids=batch.document_ids)
        loss_sum, n_valid = token_loss_sum(logits, batch.targets)
        yield microbatch_loss(loss_sum, n_valid, global_tokens, model.aux_loss())


def token_budget_reference_run(state, batching, statistic, micro: int, steps: int, world: int):
    """One float64 process over the world-1 loader of `batching()`: (grads of step 0, params after `steps`,
    `statistic(microbatch)` per microbatch and step, min top-k gap)."""
    model = Transformer(MODEL_CFG)
    model.load_state_dict(state)
    model.double()
    install_router_probe(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    loader = DataLoader(batching(), seed=5, dp_rank=0, dp_world=1, microbatches_per_rank=micro * world)
    grads0, lengths, gap = {}, [], float("inf")
    for step in range(steps):
        microbatches = loader.next_microbatches()
        lengths.append([statistic(mb) for mb in microbatches])
        global_tokens = sum(mb.n_valid_targets for mb in microbatches)
        for loss in _step_loss(model, microbatches, global_tokens):
            loss.backward()
            for moe in model.moe_layers():
                top = moe._parity_last_probs.topk(moe.cfg.top_k + 1, dim=-1).values
                gap = min(gap, float((top[:, -2] - top[:, -1]).min()))
        if step == 0:
            grads0 = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    return grads0, {n: p.detach().clone() for n, p in model.named_parameters()}, lengths, gap


def token_budget_hsdp_worker(state, batching, statistic, micro: int, steps: int):
    """On each rank: HSDP 2x2, delayed all-reduce, this rank's `micro` microbatches of `batching()`."""
    import torch.distributed as dist

    from moetrain.parallel.grad_sync import accumulation, count_global_tokens, resolve_sync_policy
    from moetrain.parallel.mesh import JobMesh
    from moetrain.parallel.process_group import init_distributed

    pcfg = parallel_cfg((2, 2), "delayed_all_reduce", "fp32")
    rank, world, device = init_distributed(pcfg)
    mesh = JobMesh.from_config(pcfg, world, device)
    model = build_model(MODEL_CFG, pcfg, mesh, device, weights="none")
    load_full_state(model, state)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    policy = resolve_sync_policy(pcfg, mesh.dims, micro)
    loader = DataLoader(batching(), seed=5, dp_rank=rank, dp_world=world, microbatches_per_rank=micro)
    grads0, lengths = {}, []
    for step in range(steps):
        microbatches = loader.next_microbatches()
        lengths.append([statistic(mb) for mb in microbatches])
        global_tokens = count_global_tokens(sum(mb.n_valid_targets for mb in microbatches))
        for batch, _is_last in accumulation(model, microbatches, policy):
            (loss,) = _step_loss(model, [batch], global_tokens)
            loss.backward()
        if step == 0:
            grads0 = {n: p.grad.full_tensor().double().numpy() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    params = {n: p.full_tensor().detach().double().numpy() for n, p in model.named_parameters()}
    dist.barrier()
    return policy.name, lengths, grads0, params
