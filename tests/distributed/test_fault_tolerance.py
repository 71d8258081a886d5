"""Fault-tolerant HSDP through torchft: a real lighthouse process and two replica groups of 2 gloo ranks.

Each group is its own `torchrun --standalone` job (FSDP over its 2 ranks); the groups sum their
gradients in torchft's managed group. Before any fault the groups train exactly what one process
trains on the same global batch (and so plain HSDP 2 x 2). When one group is SIGKILLed, the other
keeps stepping (same processes) with the loss divided by its own tokens only; the killed group,
restarted, copies the live group's state and from then on both hold bitwise-equal parameters.
A second scenario runs TP 2 inside each group against plain HSDP 2 x TP 2 and kills the lighthouse
mid-run: both groups stop with one line and a checkpoint, and resume when a new one is up. One test
per scenario: every process start costs seconds here. benchmarks/stress/ft_faults.py runs them
longer (and PP 2 / CP 2 inside the groups) and reports the stall and rejoin times.
"""

from __future__ import annotations

import io
import os
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from moetrain import cli
from moetrain.config.job import JobConfig
from moetrain.config.model import ModelConfig
from moetrain.config.moe import MoEConfig
from moetrain.config.parallel import ParallelConfig
from moetrain.config.train import TrainConfig
from moetrain.errors import ConfigError
from moetrain.parallel.fault_tolerance import data_position, load_recovery_state, recovery_state
from moetrain.parallel.mesh import JobMesh
from moetrain.testing import run_on_ranks
from moetrain.testing.replica_groups import TORCHRUN, Lighthouse, ReplicaGroupJob, read_records
from moetrain.train import run
from moetrain.train.build import build_model
from moetrain.train.optim import build_optimizer
from stdlib_corpus import copy_stdlib_modules, tiny_moe_args

CORPUS = ["bisect.py", "colorsys.py", "keyword.py", "this.py", "stat.py", "glob.py", "fnmatch.py", "genericpath.py"]
MICRO, ACCUM, GROUP_RANKS = 2, 2, 2
needs_torchrun = pytest.mark.skipif(not Path(TORCHRUN).exists(), reason="torchrun is not next to this interpreter")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return copy_stdlib_modules(tmp_path_factory.mktemp("ft_corpus"), CORPUS)


def job_args(corpus: Path, run_dir: Path, **fields: object) -> list[str]:
    """A tiny aux-loss-free MoE job (1 dense + 1 MoE layer); `a__b=v` sets --a.b v."""
    values: dict[str, object] = {
        "model.dim": 32, "model.n_layers": 2, "model.n_heads": 2, "model.ffn_hidden": 64, "model.max_seq_len": 32,
        "model.moe.n_experts": 4, "model.moe.top_k": 2, "model.moe.expert_hidden": 16,
        "model.moe.load_balance": "aux_free",
        "data.source": "dir", "data.path": str(corpus), "data.glob": "*.py", "data.seq_len": 32,
        "data.heldout_fraction": 0.0, "train.microbatch_size": MICRO, "train.grad_accum": ACCUM,
        "train.warmup_steps": 1, "train.eval_every": 0, "train.sample_tokens": 0, "train.num_threads": 1,
        "checkpoint.every": 1000, "logging.run_dir": str(run_dir), "logging.log_every": 1,
        "logging.progress_bar": False,
    }
    values.update({k.replace("__", "."): v for k, v in fields.items()})
    return tiny_moe_args(values)


def group_args(corpus: Path, root: Path, lighthouse: str, replica_id: int, steps: int, **fields: object) -> list[str]:
    ft = {"ft__enabled": True, "ft__lighthouse": lighthouse, "ft__replica_id": replica_id, "ft__replica_groups": 2,
          "ft__min_replicas": 1, "ft__quorum_timeout_s": 30, "ft__timeout_s": 20}
    return job_args(corpus, root / f"group{replica_id}", train__steps=steps, **{**ft, **fields})


@pytest.fixture
def env(tmp_path) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}


def by_step(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: r for r in records}


def kill_and_rejoin(corpus: Path, root: Path, env: dict[str, str], steps: int, kill_after: int,
                    down_steps: int) -> dict:
    """Two groups; SIGKILL group 1 early in step `kill_after + 1`; restart it once group 0 took `down_steps` alone.

    A pause file (moetrain.runtime.faults) holds the groups before chosen steps, so the kill and the
    restart land at those steps however slow the machine. Meanwhile one process trains the first
    `kill_after` steps of the same job on the same global batch (4 ranks x ACCUM microbatches), in this
    process. Returns its records, both groups' train records (group 1's from before the kill and after
    the rejoin), group 0's rank process ids before the kill and at the rejoin, and the wall times of
    the stall (the kill to group 0's next step) and of the rejoin (group 0 let go to group 1's first step).
    """
    pause = root / "pause_before_step"
    pause.write_text(str(kill_after + 1))
    paused_env = {**env, "MOETRAIN_TEST_PAUSE_STEPS_FILE": str(pause)}
    lighthouse = Lighthouse(env)
    args = [group_args(corpus, root, lighthouse.address, g, steps, checkpoint__resume="auto") for g in (0, 1)]
    group0 = ReplicaGroupJob(root / "group0", args[0], GROUP_RANKS, paused_env)
    group1 = ReplicaGroupJob(root / "group1", args[1], GROUP_RANKS, paused_env)
    try:
        reference = job_args(corpus, root / "one", train__steps=steps, train__stop_at_step=kill_after,
                             train__grad_accum=4 * ACCUM)
        assert run.main(reference) == 0
        for job in (group0, group1):
            job.wait_for(lambda job: job.last_step() >= kill_after, 120, f"step {kill_after}")
        pids_before = group0.rank_pids()
        before_kill = group1.records()
        pause.write_text(str(kill_after + 1 + down_steps))  # let both go on, then kill group 1 inside its step
        time.sleep(0.2)
        killed_at = time.monotonic()
        group1.stop()
        group0.wait_for(lambda job: job.last_step() > kill_after, 60, "a step after the kill")
        stall_s = time.monotonic() - killed_at
        group0.wait_for(lambda job: job.last_step() >= kill_after + down_steps, 60, f"{down_steps} steps alone")
        pids_at_rejoin = group0.rank_pids()
        group1 = ReplicaGroupJob(root / "group1", args[1], GROUP_RANKS, env)
        group1.wait_for(lambda job: "All workers joined" in job.log.read_text(), 120,
                        "its quorum request after the restart")
        released_at = time.monotonic()
        pause.unlink()
        group1.wait_for(lambda job: job.last_step() > 0, 60, "a step after the rejoin")
        rejoin_s = time.monotonic() - released_at
        assert [group0.wait(120), group1.wait(120)] == [0, 0], group1.log.read_text()[-3000:]
        return {"one": read_records(root / "one"), "group0": group0.records(), "group1_before": before_kill,
                "group1_after": group1.records(), "pids_before": pids_before, "pids_at_rejoin": pids_at_rejoin,
                "stall_s": stall_s, "rejoin_s": rejoin_s, "kill_after": kill_after}
    finally:
        for job in (group0, group1, lighthouse):
            job.stop()


def check_kill_and_rejoin(result: dict, steps: int) -> None:
    """What must hold after `kill_and_rejoin` (shared with benchmarks/stress/ft_kill_rejoin.py)."""
    group0 = by_step(result["group0"])
    assert sorted(group0) == list(range(1, steps + 1))  # every step taken once, none lost to the kill
    # Before the kill the two groups train what one process trains on the same global batch.
    one = by_step(result["one"])
    assert sorted(one) == list(range(1, result["kill_after"] + 1))
    for step, expected in one.items():
        assert group0[step]["ft_participants"] == [0, 1]
        assert group0[step]["valid_tokens"] == expected["valid_tokens"], step
        assert group0[step]["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-6), step
    assert one[max(one)]["loss"] < one[1]["loss"]  # it learns: equal losses are not vacuous
    assert result["pids_before"] == result["pids_at_rejoin"]  # the live group was never restarted
    # Both groups, then group 0 alone while group 1 was down (it stepped on), then both again.
    alone = [s for s, r in group0.items() if r["ft_participants"] == [0]]
    assert alone and alone == list(range(min(alone), max(alone) + 1)) and min(alone) > result["kill_after"]
    assert all(group0[s]["ft_participants"] == [0, 1] for s in group0 if s not in alone)
    rejoined = by_step(result["group1_after"])
    first = min(rejoined)
    assert first > max(alone)  # it took up at the live group's step, not at its own step 0
    for step in range(first, steps + 1):  # lock-step from the rejoin on: same weights, bit for bit
        assert rejoined[step]["param_checksum"] == group0[step]["param_checksum"], step
        assert rejoined[step]["loss"] == group0[step]["loss"], step
        assert group0[step]["ft_participants"] == [0, 1]
    # Every step's loss was divided by the tokens of the groups that took part, recomputed from each group's count.
    group1 = {**by_step(result["group1_before"]), **rejoined}
    # The SIGKILL may land after group 1 committed a step and before it logged it: that one step has no record.
    killed_in = max(by_step(result["group1_before"]), default=0) + 1
    for step, record in group0.items():
        if 1 in record["ft_participants"] and step not in group1:
            assert step == killed_in, step
            continue
        counts = {0: record["ft_group_tokens"]}
        if 1 in record["ft_participants"]:
            counts[1] = group1[step]["ft_group_tokens"]
        assert record["valid_tokens"] == sum(counts.values()), step
        sums = {0: record["ft_group_loss_sum"]}
        if 1 in record["ft_participants"]:
            sums[1] = group1[step]["ft_group_loss_sum"]
        assert record["loss"] == pytest.approx(sum(sums.values()) / sum(counts.values()), rel=1e-12), step


@needs_torchrun
def test_a_killed_group_rejoins_from_its_live_peer(corpus, tmp_path, env):
    steps = 9
    result = kill_and_rejoin(corpus, tmp_path, env, steps=steps, kill_after=3, down_steps=2)
    check_kill_and_rejoin(result, steps)


@contextmanager
def stderr_to(path: Path):
    """Send this process's fd 2, and so the stderr of ranks started meanwhile, to `path`."""
    saved = os.dup(2)
    with open(path, "w") as file:
        os.dup2(file.fileno(), 2)
    try:
        yield path
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def layout_and_lost_lighthouse(corpus: Path, root: Path, env: dict[str, str], steps: int, lost_after: int,
                               layout: dict[str, object]) -> dict:
    """Two groups of 2 ranks with `layout` inside each (e.g. parallel__tp=2); the lighthouse killed after
    step `lost_after`; a new lighthouse, both groups resumed with --checkpoint.resume auto to `steps`.

    Each group is one `run_on_ranks` call (its own process group; ranks forked, not torchrun: nothing
    here kills a group), the plain HSDP 2 x (the same layout) reference a third one of 4 ranks, all at
    once. Returns its records, both groups' records (the first launch's and the resumed one's), their
    exit codes and error lines of the first launch, and the groups' `stopped` records.
    """
    pause = root / "pause_before_step"
    pause.write_text(str(lost_after + 1))  # holds the reference too; released with the groups
    lighthouse = Lighthouse(env)
    args = lambda g, address: group_args(corpus, root, address, g, steps, ft__quorum_timeout_s=2,  # noqa: E731
                                        checkpoint__resume="auto", **layout)
    plain = job_args(corpus, root / "plain", train__steps=steps, parallel__dp_replicate=2, **layout)
    ranks = lambda argv, n=GROUP_RANKS: lambda: run_on_ranks(run.main, n, argv, timeout=300)  # noqa: E731
    saved = {name: os.environ.get(name) for name in ("MOETRAIN_TEST_PAUSE_STEPS_FILE", "OMP_NUM_THREADS")}
    os.environ.update(MOETRAIN_TEST_PAUSE_STEPS_FILE=str(pause), OMP_NUM_THREADS="1")  # the ranks' environment
    try:
        with ThreadPoolExecutor(3) as pool, stderr_to(root / "first.stderr") as log:
            running = [pool.submit(ranks(args(g, lighthouse.address))) for g in (0, 1)]
            running.append(pool.submit(ranks(plain, 2 * GROUP_RANKS)))
            deadline = time.monotonic() + 300
            while min(len(read_records(root / f"group{g}")) for g in (0, 1)) < lost_after:
                assert time.monotonic() < deadline and not any(f.done() for f in running), "no step 2"
                time.sleep(0.05)
            first = [read_records(root / f"group{g}") for g in (0, 1)]
            lighthouse.stop()
            pause.unlink()
            codes = [future.result() for future in running]
        errors = [[line for line in log.read_text().splitlines()
                   if line.startswith(f"moetrain: error: replica group {g}: ")] for g in (0, 1)]
        os.environ.pop("MOETRAIN_TEST_PAUSE_STEPS_FILE")
        lighthouse = Lighthouse(env)
        with ThreadPoolExecutor(2) as pool:
            resumed_codes = list(pool.map(lambda g: ranks(args(g, lighthouse.address))(), (0, 1)))
    finally:
        lighthouse.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return {"plain": read_records(root / "plain"), "first": first, "codes": codes[:2], "plain_code": codes[2],
            "errors": errors, "stopped": [read_records(root / f"group{g}", "stopped") for g in (0, 1)],
            "resumed_codes": resumed_codes, "resumed": [read_records(root / f"group{g}") for g in (0, 1)]}


def check_layout_and_lost_lighthouse(result: dict, steps: int, lost_after: int) -> None:
    """What must hold after `layout_and_lost_lighthouse` (shared with benchmarks/stress/ft_faults.py layouts)."""
    assert result["codes"] == [[3, 3], [3, 3]] and result["plain_code"] == [0] * 4  # 3: a collective failed
    for g, lines in enumerate(result["errors"]):
        assert len(lines) == GROUP_RANKS and len(set(lines)) == 1, lines  # the same one line on each rank
        assert f"replica group {g}: no quorum from the lighthouse" in lines[0]
        assert f"checkpoint step_{lost_after:08d} saved" in lines[0]
        assert [r["checkpoint_step"] for r in result["stopped"][g]] == [lost_after]
    assert result["resumed_codes"] == [[0, 0], [0, 0]]
    plain = by_step(result["plain"])
    assert sorted(plain) == list(range(1, steps + 1)) and plain[steps]["loss"] < plain[1]["loss"]
    for g in (0, 1):
        records = {**by_step(result["first"][g]), **by_step(result["resumed"][g])}
        assert sorted(records) == list(range(1, steps + 1))
        for step, expected in plain.items():
            assert records[step]["ft_participants"] == [0, 1]
            assert records[step]["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-6), (g, step)
    after = [by_step(records) for records in result["resumed"]]
    assert all(after[0][s]["param_checksum"] == after[1][s]["param_checksum"] for s in range(lost_after + 1, steps + 1))


@needs_torchrun
def test_tensor_parallel_groups_match_plain_hsdp_and_outlive_a_lost_lighthouse(corpus, tmp_path, env):
    """2 groups x (TP 2) through torchft equal plain HSDP 2 x TP 2 within 1e-5 at every step; the lighthouse
    killed after step 2: each group stops with one line and a checkpoint of step 2 in its own run directory,
    and resumes once a new lighthouse is up, still equal to plain HSDP, both groups bitwise equal.
    (PP 2 and CP 2 inside a group run the same scenario in benchmarks/stress/ft_faults.py layouts: too slow here.)"""
    steps, lost_after = 4, 2
    result = layout_and_lost_lighthouse(corpus, tmp_path, env, steps, lost_after, {"parallel__tp": 2})
    check_layout_and_lost_lighthouse(result, steps, lost_after)


@pytest.mark.parametrize(("fields", "named"), [
    ({"ft.enabled": True}, "ft.lighthouse"),
    ({"ft.replica_id": 2}, "ft.replica_id"),
    ({"ft.min_replicas": 3}, "ft.min_replicas"),
    ({"ft.quorum_timeout_s": 0.0}, "ft.quorum_timeout_s"),
    ({"ft.enabled": True, "ft.lighthouse": "http://h:1", "parallel.dp_replicate": 2}, "parallel.dp_replicate"),
    ({"ft.enabled": True, "ft.lighthouse": "http://h:1", "checkpoint.async_save": True}, "checkpoint.async_save"),
])
def test_bad_ft_fields_are_refused_in_one_line_naming_the_field(fields, named):
    cfg = JobConfig()
    for dotted, value in fields.items():
        section, name = dotted.split(".")
        setattr(getattr(cfg, section), name, value)
    with pytest.raises(ConfigError, match=f"^{named} = ") as err:
        cfg.validate()
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("argv", [["--bind", "not-an-address"], ["--min-replicas", "0"],
                                  ["--join-timeout-s", "0"]])
def test_lighthouse_refuses_bad_options_with_exit_2(argv, capsys):
    assert cli.main(["lighthouse", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moetrain: error: --") and "\n" not in err


def test_each_group_reads_its_share_of_plain_hsdps_global_batch():
    cfg = JobConfig()
    cfg.ft.replica_groups = 3
    shares = []
    for replica_id in range(3):
        cfg.ft.replica_id = replica_id
        shares += [data_position(cfg.ft, rank, 2) for rank in range(2)]
    # replicate-major, as plain HSDP 3 x 2 numbers its data ranks: (r * dp_shard + s) of 6
    assert shares == [(r, 6) for r in range(6)]


TINY = ModelConfig(vocab_size=32, dim=16, n_layers=2, n_dense_layers=1, n_heads=2, ffn_hidden=32, max_seq_len=8,
                   moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=8, load_balance="aux_free"))


def _step(model, optimizer, seed: int) -> None:
    tokens = torch.randint(0, TINY.vocab_size, (2, 8), generator=torch.Generator().manual_seed(seed))
    model(tokens).float().square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.update_expert_bias(lambda t: torch.distributed.all_reduce(t))


def _recovery_round_trip() -> bool:
    """A trained FSDP model's recovery state, sent through weights-only serialisation into a fresh
    model (another seed): one more identical step leaves both bitwise equal, expert bias included."""
    job = JobMesh.from_config(ParallelConfig(), 2, "cpu")
    source = build_model(TINY, ParallelConfig(), job, seed=0)
    source_opt = build_optimizer(source, TrainConfig())
    for seed in range(2):
        _step(source, source_opt, seed)
    buffer = io.BytesIO()
    torch.save(recovery_state(source, source_opt), buffer)
    buffer.seek(0)
    received = torch.load(buffer, weights_only=True)  # what the transport does: no code runs
    target = build_model(TINY, ParallelConfig(), job, seed=1)
    target_opt = build_optimizer(target, TrainConfig())
    load_recovery_state(target, target_opt, received)
    for model, optimizer in ((source, source_opt), (target, target_opt)):
        _step(model, optimizer, seed=5)
    mine, theirs = source.state_dict(), target.state_dict()
    assert any(name.endswith("expert_bias") and mine[name].abs().sum() > 0 for name in mine)
    return all(torch.equal(mine[n].to_local() if hasattr(mine[n], "to_local") else mine[n],
                           theirs[n].to_local() if hasattr(theirs[n], "to_local") else theirs[n]) for n in mine)


def test_recovery_state_makes_a_fresh_fsdp_model_and_optimizer_continue_bit_for_bit():
    assert run_on_ranks(_recovery_round_trip, 2) == [True, True]


class _DoublingManager:
    """A stand-in for torchft's Manager between two groups holding the same gradient: the SUM doubles it."""

    def allreduce(self, tensor, reduce_op):
        tensor.mul_(2)
        return _done()

    def errored(self):
        return None


@pytest.mark.parametrize(("sync_policy", "grad_accum", "managed_policy"), [
    ("auto", 3, "delayed_all_reduce"), ("auto", 1, "every_microbatch"),
    ("every_microbatch", 3, "every_microbatch"), ("final_only", 3, "final_only"),
])
def test_the_managed_all_reduce_runs_once_per_step_or_once_per_microbatch(sync_policy, grad_accum, managed_policy):
    """Each microbatch's gradient crosses the groups exactly once, whatever the policy: two groups with the same
    data end with twice one process's accumulated gradient (summed 2^k times it would be off)."""
    from moetrain.config.ft import FtConfig
    from moetrain.parallel.fault_tolerance import ReplicaGroup, managed_sync_policy
    from moetrain.parallel.grad_sync import accumulation
    from moetrain.parallel.mesh import MeshDims

    policy = managed_sync_policy(ParallelConfig(sync_policy=sync_policy), MeshDims(dp_shard=2), grad_accum,
                                 FtConfig(replica_groups=2))
    assert policy.name == managed_policy
    group = ReplicaGroup(FtConfig(replica_groups=2), _DoublingManager(), "f", policy)
    model = build_model(TINY, ParallelConfig(), None, seed=0)
    reference = build_model(TINY, ParallelConfig(), None, seed=0)
    batches = [torch.randint(0, TINY.vocab_size, (2, 8), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    for tokens, _ in group.accumulation(model, accumulation(model, batches, policy)):
        model(tokens).float().square().mean().backward()
    group.after_backward(model)
    for tokens in batches:
        reference(tokens).float().square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, 2 * q.grad, rtol=1e-6, atol=1e-7, msg=name)


def _done() -> torch.futures.Future:
    """A finished future: what the stand-in's all-reduce returns, so that .wait() does not block."""
    future = torch.futures.Future()
    future.set_result(None)
    return future
