"""The training loop: `moetrain train --config FILE [--section.field value ...]`.

Order of work, chosen so that a bad config or bad data fails before anything is
written: parse and validate the config, read and pack the corpus, join the
process group and build the mesh, check the run directory (existing checkpoints
need `--checkpoint.resume True`), then build the model on the meta device, shard
it with FSDP2, initialise it, build the optimizer, and only then restore a
checkpoint and start writing into the run directory.

One step: take `grad_accum` microbatches from the loader, count the step's valid
target tokens over all ranks (one all-reduce), run forward/backward per microbatch
under the sync policy (`grad_sync.accumulation`), each microbatch's loss being its
summed token loss (+ its token share of the MoE aux loss) over the global count;
then one small all-reduce of [loss sum, aux sum, non-finite flag] — the time a rank
spends in it is its wait for the slowest rank — clip by the global gradient norm,
and step the optimizer unless the loss or norm is NaN/inf (`train.nan_policy`).

The model, the sharding and the gradient synchronisation live in `moetrain.model`
and `moetrain.parallel`; this module only drives them.
"""

from __future__ import annotations

import json
import math
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moetrain.config import ConfigError, JobConfig, parse_job_args
from moetrain.data.corpus import load_corpus
from moetrain.data.loader import DataLoader
from moetrain.data.packing import PackedSequences, pack_documents
from moetrain.data.tokenizer import Tokenizer, build_tokenizer
from moetrain.logging import get_logger, setup_logging
from moetrain.train import checkpoint as ckpt
from moetrain.train.metrics import (
    LN2,
    MetricsWriter,
    ProgressBar,
    bits_per_byte,
    byte_histogram,
    unigram_entropy_bits,
)
from moetrain.train.optim import LRSchedule, build_optimizer, set_lr
from moetrain.train.sample import CONFIG_FILE, generate

log = get_logger("train")


class TrainingDiverged(RuntimeError):
    """Loss or gradient norm became NaN/inf under train.nan_policy = 'stop' (one-line message)."""


# ---------------------------------------------------------------- data


@dataclass
class TrainingData:
    tokenizer: Tokenizer
    train: PackedSequences
    heldout: PackedSequences | None
    token_bytes: torch.Tensor
    unigram_entropy_bits: float | None
    train_unigram_entropy_bits: float
    n_train_documents: int
    n_heldout_documents: int


def prepare_data(cfg: JobConfig) -> TrainingData:
    """Read, split, tokenize and pack the corpus (raises ConfigError for bad data)."""
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size = {cfg.model.vocab_size} is invalid: the tokenizer "
                          f"{cfg.data.tokenizer!r} needs at least {tokenizer.vocab_size}")
    corpus = load_corpus(cfg.data)
    train = pack_documents(corpus.train, tokenizer, cfg.data.seq_len)
    heldout = pack_documents(corpus.heldout, tokenizer, cfg.data.seq_len) if corpus.heldout else None
    entropy = unigram_entropy_bits(byte_histogram(d.text for d in corpus.heldout)) if corpus.heldout else None
    train_entropy = unigram_entropy_bits(byte_histogram(d.text for d in corpus.train))
    return TrainingData(tokenizer, train, heldout, tokenizer.token_byte_lengths(), entropy, train_entropy,
                        len(corpus.train), len(corpus.heldout))


# ---------------------------------------------------------------- model


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in backward instead of storing them.

    Uses the composable `checkpoint` (hooks, no wrapper module) so parameter names and
    checkpoints are unchanged. Recomputation reruns the MoE forward, which adds the
    block's expert loads to the aux-free load counter a second time: every expert's
    load doubles, so the sign-based bias update is unchanged.
    """
    from torch.distributed._composable import checkpoint

    for block in model.layers:
        checkpoint(block)


def build_model(cfg: JobConfig, mesh, device: torch.device) -> nn.Module:
    from moetrain.model.transformer import Transformer
    from moetrain.parallel.shard import apply_fsdp

    with torch.device("meta"):
        model = Transformer(cfg.model)
    if cfg.train.activation_checkpointing:
        enable_activation_checkpointing(model)
    if cfg.train.compile:
        for block in model.layers:
            block.compile()
    apply_fsdp(model, mesh, cfg.parallel)
    model.to_empty(device=device)
    model.init_weights(seed=cfg.train.seed)
    model.train()
    return model


# ---------------------------------------------------------------- helpers


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor)
    return tensor


def _all_gather_floats(values: list[float]) -> list[list[float]]:
    """Every rank's `values` (same length everywhere), indexed by rank."""
    local = torch.tensor(values, dtype=torch.float64)
    rank, world = _world()
    if world == 1:
        return [local.tolist()]
    out = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(out, local)
    return [t.tolist() for t in out]


def eval_indices(n_sequences: int, wanted: int, rank: int, world: int) -> list[int]:
    """This rank's share of `wanted` evenly spaced held-out sequences, the same set at every evaluation.

    The total is rounded down to a multiple of the world size (at least one per rank,
    repeating sequences only when there are fewer than ranks) so every rank runs the same
    number of forwards, which FSDP's collectives require. For the usual wanted (a power
    of two) and world sizes the set does not depend on the world size, so held-out numbers
    are comparable across meshes.
    """
    total = max(world, (min(wanted, n_sequences) // world) * world)
    chosen = [(i * n_sequences) // total for i in range(total)]
    return chosen[rank::world]


def check_run_dir(cfg: JobConfig) -> ckpt.CheckpointRef | None:
    """The checkpoint to resume from (or None); refuses to start a fresh run over existing checkpoints."""
    latest = ckpt.latest_complete(Path(cfg.logging.run_dir) / "checkpoints")
    if latest is not None and not cfg.checkpoint.resume:
        raise ConfigError(f"logging.run_dir = {cfg.logging.run_dir!r} already has checkpoints (newest: step "
                          f"{latest.step}); pass --checkpoint.resume True to continue it, or choose another "
                          "--logging.run_dir")
    return latest if cfg.checkpoint.resume else None


@dataclass
class StepResult:
    loss: float
    aux_loss: float
    grad_norm: float
    lr: float
    global_tokens: int
    compute_s: float
    wait_s: float
    step_s: float
    skipped: bool
    expert_load: torch.Tensor | None


# ---------------------------------------------------------------- trainer


class Trainer:
    def __init__(self, cfg: JobConfig, data: TrainingData):
        from moetrain.model.flops import count_params, flops_per_token
        from moetrain.parallel.grad_sync import resolve_sync_policy
        from moetrain.parallel.mesh import build_mesh, init_distributed

        self.cfg = cfg
        self.data = data
        if cfg.train.num_threads > 0:
            torch.set_num_threads(cfg.train.num_threads)
        self.rank, self.world, self.device = init_distributed(cfg.parallel)
        self.mesh = build_mesh(cfg.parallel, self.world, self.device.type)
        self.resume_from = check_run_dir(cfg)
        self.run_dir = Path(cfg.logging.run_dir)
        self.checkpoint_dir = self.run_dir / "checkpoints"
        self.policy = resolve_sync_policy(cfg.parallel, self.mesh, cfg.train.grad_accum)
        torch.manual_seed(cfg.train.seed)
        self.model = build_model(cfg, self.mesh, self.device)
        self.optimizer = build_optimizer(self.model, cfg.train)
        self.schedule = LRSchedule.from_config(cfg.train)
        self.loader = DataLoader(data.train, seed=cfg.train.seed, dp_rank=self.rank, dp_world=self.world)
        self.token_bytes = data.token_bytes.to(self.device)
        self.params = count_params(cfg.model)
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)
        self.step = 0
        self.skipped_steps = 0
        self.tokens_seen = 0
        self.moe_layers = self.model.moe_layers()

    # ---- state

    def trainer_state(self) -> dict[str, Any]:
        return {"skipped_steps": self.skipped_steps, "tokens_seen": self.tokens_seen, "seed": self.cfg.train.seed}

    def per_rank_state(self) -> dict[str, Any]:
        return {"loader": self.loader.state_dict(), "rng": ckpt.capture_rng_state()}

    def restore(self, ref: ckpt.CheckpointRef) -> None:
        state = ckpt.load_checkpoint(ref, self.model, self.optimizer)
        self.step = int(state["step"])
        self.skipped_steps = int(state["skipped_steps"])
        self.tokens_seen = int(state["tokens_seen"])
        ranks = state["ranks"]
        if len(ranks) == self.world:
            self.loader.load_state_dict(ranks[self.rank]["loader"])
            ckpt.restore_rng_state(ranks[self.rank]["rng"])
        else:
            # Different data-parallel world: weights and optimizer were resharded by DCP;
            # the data order cannot be replayed exactly (see docs/training.md).
            self.loader.resume_from_other_world([r["loader"] for r in ranks])
            log.warning("checkpoint was written by %d ranks, resuming on %d: data order continues approximately",
                        len(ranks), self.world)

    def save(self) -> None:
        try:
            ckpt.save_checkpoint(self.checkpoint_dir, self.step, self.model, self.optimizer, self.trainer_state(),
                                 self.per_rank_state(), self.cfg.checkpoint.keep_last)
        except ckpt.PoisonedStateError as err:
            raise TrainingDiverged(str(err)) from None

    # ---- one step

    def train_step(self) -> StepResult:
        from moetrain.parallel.grad_sync import accumulation, clip_grad_norm_, count_global_tokens
        from moetrain.train.loss import microbatch_loss, token_loss_sum

        cfg = self.cfg.train
        lr = self.schedule.lr(self.step)
        set_lr(self.optimizer, lr)
        start = time.perf_counter()
        microbatches = [self.loader.next_batch(cfg.microbatch_size).to(self.device) for _ in range(cfg.grad_accum)]
        global_tokens = count_global_tokens(microbatches, None)
        loss_sum = torch.zeros((), dtype=torch.float64)
        aux_sum = torch.zeros((), dtype=torch.float64)
        expert_load = None
        for batch, _is_last in accumulation(self.model, microbatches, self.policy):
            logits = self.model(batch.tokens, positions=batch.positions, document_ids=batch.document_ids)
            mb_loss_sum, n_valid = token_loss_sum(logits, batch.targets)
            aux = self.model.aux_loss()
            microbatch_loss(mb_loss_sum, n_valid, global_tokens, aux).backward()
            loss_sum += mb_loss_sum.detach().double().cpu()
            aux_sum += float(n_valid) * aux.detach().double().cpu()
            if self.moe_layers:
                load = torch.stack([m.tokens_per_expert.cpu() for m in self.moe_layers]).double()
                expert_load = load if expert_load is None else expert_load + load
        compute_s = time.perf_counter() - start
        # The first collective after the local work: how long this rank waits here is
        # how much earlier it finished than the slowest rank.
        wait_start = time.perf_counter()
        local_finite = bool(torch.isfinite(loss_sum)) and bool(torch.isfinite(aux_sum))
        summary = torch.stack([loss_sum, aux_sum, torch.tensor(0.0 if local_finite else 1.0, dtype=torch.float64)])
        summary = _all_reduce_sum(summary.to(self.device)).cpu()
        wait_s = time.perf_counter() - wait_start
        denominator = max(global_tokens, 1)
        loss = float(summary[0]) / denominator
        aux_loss = float(summary[1]) / denominator
        grad_norm = float(clip_grad_norm_(self.model, cfg.grad_clip if cfg.grad_clip > 0 else float("inf")))
        finite = summary[2].item() == 0 and math.isfinite(grad_norm) and math.isfinite(loss)
        if finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if finite:
            self.model.update_expert_bias(_all_reduce_sum if self.world > 1 else None)
        else:
            for moe in self.moe_layers:  # this step's loads are not applied
                moe.load_since_update.zero_()
        self.step += 1
        self.tokens_seen += cfg.microbatch_size * cfg.grad_accum * self.cfg.data.seq_len * self.world
        return StepResult(loss, aux_loss, grad_norm, lr, global_tokens, compute_s, wait_s,
                          time.perf_counter() - start, not finite, expert_load)

    # ---- evaluation

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        from moetrain.train.loss import token_loss_sum

        heldout = self.data.heldout
        assert heldout is not None
        mb = self.cfg.train.microbatch_size
        indices = eval_indices(len(heldout), self.cfg.train.eval_batches * mb, self.rank, self.world)
        totals = torch.zeros(3, dtype=torch.float64)  # loss sum, valid targets, bytes
        self.model.eval()
        try:
            for lo in range(0, len(indices), mb):
                batch = heldout.batch(indices[lo: lo + mb]).to(self.device)
                logits = self.model(batch.tokens, positions=batch.positions, document_ids=batch.document_ids)
                loss_sum, n_valid = token_loss_sum(logits, batch.targets)
                valid = batch.targets != -100
                n_bytes = self.token_bytes[batch.targets[valid]].sum()
                totals += torch.tensor([float(loss_sum), float(n_valid), float(n_bytes)], dtype=torch.float64)
        finally:
            self.model.train()
        _all_reduce_sum(totals)
        loss_sum, n_tokens, n_bytes = totals.tolist()
        return {"heldout_loss": loss_sum / max(n_tokens, 1), "heldout_bpb": bits_per_byte(loss_sum, int(n_bytes)),
                "heldout_tokens": int(n_tokens)}


# ---------------------------------------------------------------- the run


def _format_si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


def _train_record(trainer: Trainer, result: StepResult, window: list[StepResult]) -> dict[str, Any]:
    cfg = trainer.cfg
    tokens_per_rank_step = cfg.train.microbatch_size * cfg.train.grad_accum * cfg.data.seq_len
    per_rank = _all_gather_floats([result.compute_s, result.wait_s, result.step_s])
    global_tokens_per_s = tokens_per_rank_step * trainer.world / result.step_s
    record: dict[str, Any] = {
        "kind": "train", "step": trainer.step, "loss": result.loss,
        "loss_avg": sum(r.loss for r in window) / len(window), "aux_loss": result.aux_loss,
        "lr": result.lr, "grad_norm": result.grad_norm, "valid_tokens": result.global_tokens,
        "tokens_per_s": global_tokens_per_s, "tokens_per_s_per_rank": [tokens_per_rank_step / r[2] for r in per_rank],
        "step_s": result.step_s, "compute_s_per_rank": [r[0] for r in per_rank],
        "wait_s_per_rank": [r[1] for r in per_rank],
        "mfu": trainer.flops_per_token * global_tokens_per_s / (cfg.train.peak_flops * trainer.world),
        "tokens_seen": trainer.tokens_seen, "skipped_steps": trainer.skipped_steps,
    }
    if result.expert_load is not None:
        load = _all_reduce_sum(result.expert_load.clone())
        ratio = (load.max(dim=1).values / load.mean(dim=1).clamp_min(1e-9)).tolist()
        record["expert_load_max_over_mean"] = sum(ratio) / len(ratio)
        record["expert_load_max_over_mean_per_layer"] = ratio
    return record


def _console_line(record: dict[str, Any], total_steps: int) -> str:
    line = (f"step {record['step']}/{total_steps} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
            f"gnorm {record['grad_norm']:.3f} | {_format_si(record['tokens_per_s'])} tok/s | "
            f"step {record['step_s']:.2f}s (compute {max(record['compute_s_per_rank']):.2f}, "
            f"wait {max(record['wait_s_per_rank']):.2f}) | MFU {100 * record['mfu']:.2f}%")
    if "expert_load_max_over_mean" in record:
        line += f" | experts max/mean {record['expert_load_max_over_mean']:.2f}"
    return line


def run(cfg: JobConfig) -> dict[str, Any]:
    """Train per `cfg`; return the final record (rank 0's view)."""
    data = prepare_data(cfg)
    owns_process_group = not (dist.is_available() and dist.is_initialized())
    completed = False
    try:
        result = _run(Trainer(cfg, data))
        completed = True
        return result
    finally:
        # Also when the Trainer could not be built (e.g. a mesh that does not fit the world).
        if owns_process_group and dist.is_initialized():
            if completed and dist.get_world_size() > 1:
                # Without it a rank that finishes first tears down its gloo connections while
                # a peer is still in its last collective, and the peer aborts at exit.
                dist.barrier()
            dist.destroy_process_group()


def _run(trainer: Trainer) -> dict[str, Any]:
    cfg = trainer.cfg
    if trainer.resume_from is not None:
        trainer.restore(trainer.resume_from)
    is_rank0 = trainer.rank == 0
    if is_rank0:
        trainer.run_dir.mkdir(parents=True, exist_ok=True)
        ckpt.remove_partial(trainer.checkpoint_dir)  # writes interrupted in an earlier run, never complete
        (trainer.run_dir / CONFIG_FILE).write_text(json.dumps(cfg.to_dict(), indent=2))
        if trainer.resume_from is None and (trainer.run_dir / "metrics.jsonl").exists():
            (trainer.run_dir / "metrics.jsonl").unlink()  # no checkpoint: nothing of that run can continue
    _setup_logging(trainer.run_dir / "logs" if cfg.logging.all_ranks_to_files else None)
    writer = MetricsWriter(trainer.run_dir, enabled=is_rank0, tensorboard=cfg.logging.tensorboard)
    data = trainer.data
    start_record = {
        "kind": "event", "event": "resume" if trainer.resume_from else "start", "step": trainer.step,
        "world_size": trainer.world, "params_total": trainer.params["total"], "params_active": trainer.params["active"],
        "flops_per_token": trainer.flops_per_token, "train_sequences": len(data.train),
        "train_documents": data.n_train_documents, "heldout_documents": data.n_heldout_documents,
        "sync_policy": trainer.policy.name, "time": time.time(),
    }
    writer.write(start_record)
    log.info("%s at step %d: %d ranks (mesh %s, sync %s), %.2fM params (%.2fM active/token), %d train documents "
             "-> %d sequences of %d tokens, %d held-out documents", start_record["event"], trainer.step,
             trainer.world, "none" if trainer.mesh is None else tuple(trainer.mesh.shape), trainer.policy.name,
             trainer.params["total"] / 1e6, trainer.params["active"] / 1e6, data.n_train_documents,
             len(data.train), cfg.data.seq_len, data.n_heldout_documents)
    last_step = cfg.train.stop_at_step or cfg.train.steps
    bar = ProgressBar(total=cfg.train.steps, initial=trainer.step, enabled=is_rank0 and cfg.logging.progress_bar)
    window: list[StepResult] = []
    final: dict[str, Any] = {}
    run_start = time.perf_counter()
    steps_this_run = 0
    try:
        redirect = _redirect_logs_above(bar)
        with redirect:
            while trainer.step < last_step:
                result = trainer.train_step()
                steps_this_run += 1
                window.append(result)
                if result.skipped:
                    _handle_nonfinite(trainer, result, writer)
                bar.update({"loss": f"{result.loss:.3f}", "lr": f"{result.lr:.1e}"})
                if trainer.step % cfg.logging.log_every == 0 or trainer.step == last_step:
                    record = _train_record(trainer, result, window)
                    window = []
                    writer.write(record)
                    log.info(_console_line(record, cfg.train.steps))
                evaluate_now = cfg.train.eval_every > 0 and trainer.step % cfg.train.eval_every == 0
                if data.heldout is not None and evaluate_now and trainer.step != cfg.train.steps:
                    ev = trainer.evaluate()
                    writer.write({"kind": "eval", "step": trainer.step, **ev})
                    log.info("step %d | held-out loss %.4f | %.4f bits/byte", trainer.step, ev["heldout_loss"],
                             ev["heldout_bpb"])
                at_interval = trainer.step % cfg.checkpoint.every == 0
                if cfg.checkpoint.enabled and (at_interval or trainer.step == last_step):
                    trainer.save()
                    log.info("checkpoint saved: %s", trainer.checkpoint_dir / ckpt.step_dir_name(trainer.step))
        bar.close()
        wall_s = time.perf_counter() - run_start
        if trainer.step < cfg.train.steps:
            log.info("stopped at step %d of %d (train.stop_at_step); resume with --checkpoint.resume True",
                     trainer.step, cfg.train.steps)
            final = {"kind": "stopped", "step": trainer.step, "wall_s": wall_s}
            writer.write(final)
            return final
        final = _finish(trainer, writer, wall_s, steps_this_run)
        return final
    finally:
        bar.close()
        writer.close()


def _redirect_logs_above(bar: ProgressBar):
    if not bar.active:
        return nullcontext()
    import logging

    from tqdm.contrib.logging import logging_redirect_tqdm

    return logging_redirect_tqdm(loggers=[logging.getLogger("moetrain")])


def _handle_nonfinite(trainer: Trainer, result: StepResult, writer: MetricsWriter) -> None:
    what = f"step {trainer.step}: loss {result.loss} / grad norm {result.grad_norm} is not finite"
    if trainer.cfg.train.nan_policy == "stop":
        latest = ckpt.latest_complete(trainer.checkpoint_dir)
        where = f"newest complete checkpoint: step {latest.step}" if latest else "no checkpoint was written"
        raise TrainingDiverged(f"{what}; stopping (train.nan_policy = 'stop'); {where}")
    trainer.skipped_steps += 1
    writer.write({"kind": "event", "event": "skipped_step", "step": trainer.step, "loss": result.loss,
                  "grad_norm": result.grad_norm, "skipped_steps": trainer.skipped_steps})
    log.warning("%s; update skipped (train.nan_policy = 'skip', %d skipped so far)", what, trainer.skipped_steps)


def _finish(trainer: Trainer, writer: MetricsWriter, wall_s: float, steps_this_run: int) -> dict[str, Any]:
    cfg, data = trainer.cfg, trainer.data
    final: dict[str, Any] = {"kind": "final", "step": trainer.step, "wall_s": wall_s, "steps_this_run": steps_this_run,
                             "skipped_steps": trainer.skipped_steps, "tokens_seen": trainer.tokens_seen}
    if data.heldout is not None:
        ev = trainer.evaluate()
        writer.write({"kind": "eval", "step": trainer.step, **ev})
        final.update(ev)
        final["unigram_entropy_bits"] = data.unigram_entropy_bits
        final["train_unigram_entropy_bits"] = data.train_unigram_entropy_bits
        log.info("held-out: loss %.4f nats/token, %.4f bits/byte; unigram byte entropy: held-out text %.4f "
                 "bits/byte (%.4f nats/byte), training text %.4f bits/byte", ev["heldout_loss"], ev["heldout_bpb"],
                 data.unigram_entropy_bits, data.unigram_entropy_bits * LN2, data.train_unigram_entropy_bits)
    else:
        log.info("no held-out documents (data.heldout_fraction = 0): no held-out loss")
    if cfg.train.sample_tokens > 0:
        text = generate(trainer.model, data.tokenizer, cfg.train.sample_prompt, cfg.train.sample_tokens,
                        cfg.train.sample_temperature, cfg.train.sample_top_p, seed=cfg.train.seed,
                        device=trainer.device, max_context=cfg.data.seq_len)
        final["sample"] = cfg.train.sample_prompt + text
        if trainer.rank == 0:
            print(f"--- sample (T={cfg.train.sample_temperature}, top-p={cfg.train.sample_top_p}) ---\n"
                  f"{final['sample']}\n--- end of sample ---", flush=True)
    writer.write(final)
    log.info("done: %d steps in %.1f s this run", steps_this_run, wall_s)
    return final


def _setup_logging(log_dir: Path | None = None) -> None:
    import logging

    logger = setup_logging(log_dir=log_dir)
    if not logger.handlers:
        # Ranks other than 0 have no console handler; without any handler Python's
        # last-resort handler would print their warnings unformatted.
        logger.addHandler(logging.NullHandler())


def main(argv: list[str]) -> int:
    cfg = parse_job_args(argv, prog="moetrain train")
    _setup_logging()
    try:
        run(cfg)
    except TrainingDiverged as err:
        print(f"moetrain: error: {err}", file=sys.stderr, flush=True)
        return 1
    return 0
