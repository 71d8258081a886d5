"""Per-rank activation memory of one long row under context parallelism against one process, and the losses.

    PYTHONPATH=$PWD/src:$PWD python benchmarks/profile/context_parallel_memory.py --seq 16384 --cp 4

A tiny MoE (dim 64, one dense and one MoE block, 4 heads) trains 2 SGD steps on one row of `--seq`
tokens packed with documents of seq/4 tokens (cut so documents cross the CP chunks). Run once in one
process (no CP, `model.attention = "auto"`) and once on `--cp` gloo ranks (CP only). The activation
memory of a step is the rise of the resident set's high-water mark above the RSS before that step
(step 2, after a warm-up step: /proc/self/clear_refs resets the mark, `moetrain.observe.peak_memory`);
each CP rank reports its own. Prints one JSON line: the single process's and each rank's activation
bytes, the ratio of the largest rank to the single process, and both runs' losses.
Not a test: slow, and its numbers depend on the allocator and the machine.
"""

from __future__ import annotations

import argparse
import json

import torch

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.config.parallel import ParallelConfig
from moetrain.data.packing import Batch
from moetrain.model.layers import positions_from_documents
from moetrain.observe.peak_memory import PeakMemory, current_rss_bytes
from moetrain.testing import run_on_ranks
from moetrain.train.build import build_model
from moetrain.train.loss import token_loss_sum


def model_config(seq: int) -> ModelConfig:
    return ModelConfig(vocab_size=272, dim=64, n_layers=2, n_dense_layers=1, n_heads=4, ffn_hidden=128,
                       max_seq_len=seq, moe=MoEConfig(n_experts=8, top_k=2, expert_hidden=32, aux_loss_coef=0.0))


def long_row(seq: int, vocab: int, seed: int = 0) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    ids = ((torch.arange(seq) + seq // 8) // (seq // 4)).unsqueeze(0)  # documents of seq/4, offset by seq/8
    tokens = torch.randint(0, vocab, (1, seq), generator=gen)
    return Batch(tokens, positions_from_documents(ids), ids, torch.roll(tokens, -1, dims=1))


def train_two_steps(model, inputs, targets, loss_scale: float, loss_context, local_loss) -> tuple[list, int]:
    """(loss per step, activation bytes of step 2)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    memory = PeakMemory(torch.device("cpu"))
    losses, activation = [], 0
    for step in range(2):
        memory.read_and_reset()
        before = current_rss_bytes()
        logits = model(**inputs)
        with loss_context():
            loss, _ = token_loss_sum(logits, targets)
            loss = local_loss(loss)
            (loss * loss_scale).backward()
        peak = memory.read_and_reset()["peak_rss"]
        if step == 1:
            activation = int(peak - before)
        losses.append(float(loss.detach()))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, activation


def single_process(seq: int) -> dict:
    from contextlib import nullcontext

    cfg = model_config(seq)
    torch.manual_seed(0)
    model = build_model(cfg, weights="init")
    batch = long_row(seq, cfg.vocab_size)
    inputs = {"tokens": batch.tokens, "positions": batch.positions, "document_ids": batch.document_ids}
    losses, activation = train_two_steps(model, inputs, batch.targets, 1.0 / seq, nullcontext, lambda t: t)
    return {"losses": [loss / seq for loss in losses], "activation_bytes": activation}


def cp_rank(seq: int, cp: int) -> dict:
    import torch.distributed as dist

    from moetrain.parallel.context_parallel import SequenceSplit
    from moetrain.parallel.mesh import JobMesh
    from moetrain.parallel.process_group import init_distributed

    cfg = model_config(seq)
    pcfg = ParallelConfig(cp=cp)
    _, world, device = init_distributed(pcfg)
    torch.manual_seed(0)
    job = JobMesh.from_config(pcfg, world, device)
    model = build_model(cfg, pcfg, job, device, weights="init")
    split = SequenceSplit.of(job)
    batch = long_row(seq, cfg.vocab_size)
    losses, activation = train_two_steps(model, split.model_inputs(batch), split.shard(batch.targets), 1.0 / seq,
                                         split.loss_context, split.local_loss)
    totals = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(totals)
    return {"losses": (totals / seq).tolist(), "activation_bytes": activation}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--cp", type=int, default=4)
    args = parser.parse_args()
    one = single_process(args.seq)
    ranks = run_on_ranks(cp_rank, args.cp, args.seq, args.cp, timeout=3600)
    largest = max(r["activation_bytes"] for r in ranks)
    print(json.dumps({"seq": args.seq, "cp": args.cp, "single_activation_bytes": one["activation_bytes"],
                      "cp_rank_activation_bytes": [r["activation_bytes"] for r in ranks],
                      "largest_rank_over_single": largest / one["activation_bytes"],
                      "single_losses": one["losses"], "cp_losses": ranks[0]["losses"]}))


if __name__ == "__main__":
    main()
