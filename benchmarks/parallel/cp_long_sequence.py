"""Per-rank activation memory of one long row under context parallelism against one process, and the losses.

    PYTHONPATH=$PWD/src:$PWD python benchmarks/parallel/cp_long_sequence.py --seq 16384 --cp 4 \
        --out benchmarks/results/cp_long_sequence_16k.json

A tiny MoE (dim 64, one dense and one MoE block, 4 heads) trains 2 SGD steps on one row of `--seq`
tokens packed with documents of seq/4 tokens (cut so documents cross the CP chunks). Run once in one
process (no CP, `model.attention = "auto"`) and once on `--cp` gloo ranks (CP only). The activation
memory of a step is measured two ways, each rank its own:
- `activation_bytes`: the rise of the resident set's high-water mark above the RSS before that step (step 2,
  after a warm-up step: /proc/self/clear_refs resets the mark, `moetrain.observe.peak_memory`): everything
  the step holds at its peak (saved activations, the backward's transients). Both runs fix glibc's mmap
  threshold at 64 KiB (`mallopt`; glibc otherwise raises it as large blocks are freed, and freed heap then
  stays resident in amounts that vary run to run): every tensor of 64 KiB or more is its own mapping,
  returned when freed, so the rise is the live bytes at the peak, not the heap's slack (`--glibc-default`
  measures with glibc's dynamic threshold instead);
- `saved_bytes`: the bytes of the distinct storages autograd saves for backward during step 2's forward
  (`torch.autograd.graph.saved_tensors_hooks`; parameters and their unsharded copies included, a few
  hundred KB here): the activation memory proper, independent of the allocator.
Prints one JSON line (and writes it to --out): both measures for the single process and each rank, the
largest rank's ratio to the single process for each, and both runs' losses.
Not a test: slow, and its numbers depend on the allocator and the machine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.config.parallel import ParallelConfig
from moetrain.data.packing import Batch
from moetrain.libc import M_MMAP_THRESHOLD, glibc_mallopt
from moetrain.model.layers import positions_from_documents
from moetrain.observe.peak_memory import PeakMemory, current_rss_bytes
from moetrain.testing import run_on_ranks
from moetrain.train.build import build_model
from moetrain.train.loss import token_loss_sum

MMAP_THRESHOLD = 64 * 1024


def model_config(seq: int) -> ModelConfig:
    return ModelConfig(vocab_size=272, dim=64, n_layers=2, n_dense_layers=1, n_heads=4, ffn_hidden=128,
                       max_seq_len=seq, moe=MoEConfig(n_experts=8, top_k=2, expert_hidden=32, aux_loss_coef=0.0))


def long_row(seq: int, vocab: int, seed: int = 0) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    ids = ((torch.arange(seq) + seq // 8) // (seq // 4)).unsqueeze(0)  # documents of seq/4, offset by seq/8
    tokens = torch.randint(0, vocab, (1, seq), generator=gen)
    return Batch(tokens, positions_from_documents(ids), ids, torch.roll(tokens, -1, dims=1))


class SavedBytes:
    """Bytes of the distinct storages autograd saves while it is active (a saved_tensors_hooks context)."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def fix_mmap_threshold(glibc_default: bool) -> None:
    mallopt = glibc_mallopt()
    if not glibc_default and mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def train_two_steps(model, inputs, targets, loss_scale: float, loss_context, local_loss) -> tuple[list, int, int]:
    """(loss per step, peak-RSS rise of step 2, bytes saved for backward by step 2's forward)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    memory = PeakMemory(torch.device("cpu"))
    losses, activation, saved = [], 0, SavedBytes()
    for step in range(2):
        memory.read_and_reset()
        before = current_rss_bytes()
        if step == 1:
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
                logits = model(**inputs)
        else:
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
    return losses, activation, saved.total


def single_process(seq: int, glibc_default: bool) -> dict:
    from contextlib import nullcontext

    fix_mmap_threshold(glibc_default)
    cfg = model_config(seq)
    torch.manual_seed(0)
    model = build_model(cfg, weights="init")
    batch = long_row(seq, cfg.vocab_size)
    inputs = {"tokens": batch.tokens, "positions": batch.positions, "document_ids": batch.document_ids}
    losses, activation, saved = train_two_steps(model, inputs, batch.targets, 1.0 / seq, nullcontext, lambda t: t)
    return {"losses": [loss / seq for loss in losses], "activation_bytes": activation, "saved_bytes": saved}


def cp_rank(seq: int, cp: int, glibc_default: bool) -> dict:
    import torch.distributed as dist

    from moetrain.parallel.context_parallel import SequenceSplit
    from moetrain.parallel.mesh import JobMesh
    from moetrain.parallel.process_group import init_distributed

    fix_mmap_threshold(glibc_default)
    cfg = model_config(seq)
    pcfg = ParallelConfig(cp=cp)
    _, world, device = init_distributed(pcfg)
    torch.manual_seed(0)
    job = JobMesh.from_config(pcfg, world, device)
    model = build_model(cfg, pcfg, job, device, weights="init")
    split = SequenceSplit.of(job)
    batch = long_row(seq, cfg.vocab_size)
    losses, activation, saved = train_two_steps(model, split.model_inputs(batch), split.shard(batch.targets),
                                                1.0 / seq, split.loss_context, split.local_loss)
    totals = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(totals)
    return {"losses": (totals / seq).tolist(), "activation_bytes": activation, "saved_bytes": saved}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--glibc-default", action="store_true", help="keep glibc's dynamic mmap threshold")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    one = run_on_ranks(single_process, 1, args.seq, args.glibc_default, timeout=3600)[0]
    ranks = run_on_ranks(cp_rank, args.cp, args.seq, args.cp, args.glibc_default, timeout=3600)
    result = {"seq": args.seq, "cp": args.cp, "glibc_default_mmap_threshold": args.glibc_default}
    for measure in ("activation_bytes", "saved_bytes"):
        result[f"single_{measure}"] = one[measure]
        result[f"cp_rank_{measure}"] = [r[measure] for r in ranks]
        result[f"largest_rank_over_single_{measure}"] = max(r[measure] for r in ranks) / one[measure]
    result.update(single_losses=one["losses"], cp_losses=ranks[0]["losses"])
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
