"""Expert parallelism without ranks: config checks (one-line errors, exit 2), the receive-order permutation,
and the all-to-all's split bookkeeping against a hand-built exchange.

The multi-rank behaviour (parity, checkpoints, metrics) is in tests/distributed/test_expert_parallel.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moetrain.config.job import JobConfig, parse_job_args
from moetrain.config.parallel import ParallelConfig, check_world_size
from moetrain.errors import ConfigError
from moetrain.parallel.expert_parallel import expert_major_order

TINY = str(Path(__file__).resolve().parents[2] / "configs" / "tiny_moe.toml")


@pytest.mark.parametrize("overrides,needle", [
    (["--parallel.ep", "3"], "parallel.ep = 3 is invalid: must divide model.moe.n_experts = 16"),
    (["--parallel.ep", "0"], "parallel.ep = 0 is invalid: must be a positive integer"),
    (["--parallel.ep", "2", "--model.n_dense_layers", "4"], "parallel.ep = 2 is invalid: expert parallelism needs"),
])
def test_bad_ep_is_one_line(overrides, needle):
    with pytest.raises(ConfigError) as err:
        parse_job_args(["--config", TINY, *overrides])
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("replicate,shard,ep,world,expected", [
    (1, -1, 4, 4, (1, 4)), (1, -1, 2, 4, (1, 4)), (2, 2, 2, 4, (2, 2)), (2, -1, 1, 4, (2, 2)), (1, 8, 8, 8, (1, 8)),
])
def test_ep_divides_the_shard_dimension(replicate, shard, ep, world, expected):
    assert check_world_size(ParallelConfig(dp_replicate=replicate, dp_shard=shard, ep=ep), world) == expected


@pytest.mark.parametrize("replicate,shard,ep,world", [(2, 2, 4, 4), (1, 6, 4, 6), (4, 1, 2, 4), (1, -1, 8, 4)])
def test_ep_that_does_not_divide_the_shard_dimension_is_one_line(replicate, shard, ep, world):
    with pytest.raises(ConfigError) as err:
        check_world_size(ParallelConfig(dp_replicate=replicate, dp_shard=shard, ep=ep), world)
    message = str(err.value)
    assert message.startswith(f"parallel.ep = {ep} is invalid: must divide the data-parallel shard size")
    assert "\n" not in message


def test_cli_ep_not_dividing_experts_exits_2_with_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "moetrain", "train", "--config", TINY, "--parallel.ep", "5",
                           "--logging.run_dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "moetrain: error: parallel.ep = 5 is invalid: must divide model.moe.n_experts = 16 (each rank owns whole "
        "experts)"]
    assert not (tmp_path / "run").exists()


def test_default_is_no_expert_parallelism():
    assert JobConfig().parallel.ep == 1


def _loop_order(counts_SJ: torch.Tensor) -> list[int]:
    """Reference: walk the received buffer (source-major, expert-minor), then list rows expert by expert."""
    sources, experts = counts_SJ.shape
    rows_of: dict[tuple[int, int], list[int]] = {}
    row = 0
    for s in range(sources):
        for j in range(experts):
            rows_of[(s, j)] = list(range(row, row + int(counts_SJ[s, j])))
            row += int(counts_SJ[s, j])
    return [r for j in range(experts) for s in range(sources) for r in rows_of[(s, j)]]


@pytest.mark.parametrize("counts", [
    [[2, 0, 1], [0, 3, 1]],          # an expert with no rows from one source
    [[0, 0], [0, 0], [0, 0]],        # nothing received at all
    [[5], [0], [2], [1]],            # one local expert
    [[1, 2, 3, 4], [4, 3, 2, 1]],
])
def test_expert_major_order_matches_a_loop(counts):
    counts_SJ = torch.tensor(counts)
    assert expert_major_order(counts_SJ).tolist() == _loop_order(counts_SJ)


def test_expert_major_order_groups_a_simulated_exchange_by_expert():
    # Two sources, four global experts, two EP ranks: simulate what rank 1 (experts 2, 3) receives.
    gen = torch.Generator().manual_seed(0)
    per_source = [torch.randint(0, 4, (7,), generator=gen) for _ in range(2)]  # each source's assignment experts
    received = []  # (global expert, source) of each received row, in arrival order
    counts = torch.zeros(2, 2, dtype=torch.long)
    for s, experts in enumerate(per_source):
        for e in sorted(int(e) for e in experts if e >= 2):  # grouped by expert, as routing delivers
            received.append((e, s))
            counts[s, e - 2] += 1
    order = expert_major_order(counts)
    assert [received[i] for i in order.tolist()] == sorted(received)
