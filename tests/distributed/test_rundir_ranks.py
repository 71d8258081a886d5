"""The run directory's checks at the start of a multi-rank run take rank 0's view, the writer's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch.distributed as dist

from moetrain.config.job import from_dict
from moetrain.errors import ConfigError
from moetrain.runtime.run_dir import RunDir, refuse_foreign_outputs
from moetrain.testing import run_on_ranks


def _refusal_per_rank(dirs_by_rank: list[str]) -> str:
    run_dir = RunDir(Path(dirs_by_rank[dist.get_rank()]))
    try:
        refuse_foreign_outputs(run_dir, from_dict({}).validate())
    except ConfigError as err:
        return str(err)
    return ""


def _dirs(tmp_path: Path, with_config: list[bool]) -> list[str]:
    dirs = []
    for rank, has_config in enumerate(with_config):
        root = tmp_path / f"seen_by_rank{rank}"
        root.mkdir()
        if has_config:
            (root / "config.json").write_text("{}")
        dirs.append(str(root))
    return dirs


def test_a_peer_that_sees_the_config_rank_0_just_wrote_does_not_refuse_the_run(tmp_path):
    # Rank 1 looks after rank 0 has written this run's config.json (simulated with two directories).
    assert run_on_ranks(_refusal_per_rank, 2, _dirs(tmp_path, [False, True])) == ["", ""]


@pytest.mark.parametrize("world", [2, 3])
def test_another_runs_config_found_by_rank_0_stops_every_rank_with_the_same_line(tmp_path, world):
    messages = run_on_ranks(_refusal_per_rank, world, _dirs(tmp_path, [True] + [False] * (world - 1)))
    assert messages[0].startswith("logging.run_dir = ") and "already holds config.json of another run" in messages[0]
    assert "seen_by_rank0" in messages[0]
    # Each rank names the directory it was given; in a real job they are one directory.
    same_dir = [re.sub(r"seen_by_rank\d", "DIR", m) for m in messages]
    assert same_dir == [same_dir[0]] * world
