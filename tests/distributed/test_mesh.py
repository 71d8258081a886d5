"""The job's mesh: the ranks of every sub-mesh and process group per layout, and who owns the process group.

One 4-rank spawn lays out every 4-rank layout in turn (FSDP, HSDP, replication, EP 2 and 4
within FSDP 4, HSDP 2x2 with EP 2, and the coming pp / cp / tp dimensions); the one-rank
cases run in this process.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from moetrain.config.parallel import ParallelConfig
from moetrain.errors import ConfigError
from moetrain.parallel.mesh import JobMesh, MeshDims
from moetrain.parallel.process_group import distributed_job, init_distributed, owned_process_group
from moetrain.testing import run_on_ranks

SUB_MESHES = ("data", "fsdp", "expert_ep", "expert_fsdp", "pipeline", "context", "tensor")

LAYOUTS = {
    "fsdp4": MeshDims.from_config(ParallelConfig(), 4),
    "hsdp2x2": MeshDims.from_config(ParallelConfig(dp_replicate=2, dp_shard=2), 4),
    "replicate4": MeshDims.from_config(ParallelConfig(dp_replicate=4), 4),
    "ep2_fsdp4": MeshDims.from_config(ParallelConfig(ep=2), 4),
    "ep4_fsdp4": MeshDims.from_config(ParallelConfig(ep=4), 4),
    "hsdp2x2_ep2": MeshDims.from_config(ParallelConfig(dp_replicate=2, dp_shard=2, ep=2), 4),
    "pp2_fsdp2": MeshDims(pp=2, dp_shard=2),
    "fsdp2_cp2": MeshDims(dp_shard=2, cp=2),
    "fsdp2_tp2": MeshDims(dp_shard=2, tp=2),
    "cp2_tp2": MeshDims(cp=2, tp=2),
}

R, S = ("dp_replicate",), ("dp_shard",)
RS = R + S
# layout -> sub-mesh -> (dim names, this rank's sub-mesh as nested rank lists for ranks 0, 1, 2, 3)
EXPECTED = {
    "fsdp4": {"data": (RS, [[[0, 1, 2, 3]]] * 4), "fsdp": (S, [[0, 1, 2, 3]] * 4)},
    "hsdp2x2": {"data": (RS, [[[0, 1], [2, 3]]] * 4), "fsdp": (RS, [[[0, 1], [2, 3]]] * 4)},
    "replicate4": {"data": (RS, [[[0], [1], [2], [3]]] * 4), "fsdp": (RS, [[[0], [1], [2], [3]]] * 4)},
    "ep2_fsdp4": {"data": (RS, [[[0, 1, 2, 3]]] * 4), "fsdp": (S, [[0, 1, 2, 3]] * 4),
                  "expert_ep": (("ep",), [[0, 1], [0, 1], [2, 3], [2, 3]]),
                  "expert_fsdp": (("efsdp",), [[0, 2], [1, 3], [0, 2], [1, 3]])},
    "ep4_fsdp4": {"data": (RS, [[[0, 1, 2, 3]]] * 4), "fsdp": (S, [[0, 1, 2, 3]] * 4),
                  "expert_ep": (("ep",), [[0, 1, 2, 3]] * 4),
                  "expert_fsdp": (("efsdp",), [[0], [1], [2], [3]])},
    "hsdp2x2_ep2": {"data": (RS, [[[0, 1], [2, 3]]] * 4), "fsdp": (RS, [[[0, 1], [2, 3]]] * 4),
                    "expert_ep": (("ep",), [[0, 1], [0, 1], [2, 3], [2, 3]]),
                    "expert_fsdp": (("dp_replicate", "efsdp"), [[[0], [2]], [[1], [3]], [[0], [2]], [[1], [3]]])},
    "pp2_fsdp2": {"data": (RS, [[[0, 1]], [[0, 1]], [[2, 3]], [[2, 3]]]),
                  "fsdp": (S, [[0, 1], [0, 1], [2, 3], [2, 3]]),
                  "pipeline": (("pp",), [[0, 2], [1, 3], [0, 2], [1, 3]])},
    # CP ranks join FSDP's shard dimension; the routed experts, which TP does not split, shard over TP's too.
    "fsdp2_cp2": {"data": (RS, [[[0, 2]], [[1, 3]], [[0, 2]], [[1, 3]]]),
                  "fsdp": (("dp_shard_cp",), [[0, 1, 2, 3]] * 4),
                  "context": (("cp",), [[0, 1], [0, 1], [2, 3], [2, 3]])},
    "fsdp2_tp2": {"data": (RS, [[[0, 2]], [[1, 3]], [[0, 2]], [[1, 3]]]),
                  "fsdp": (S, [[0, 2], [1, 3], [0, 2], [1, 3]]),
                  "expert_fsdp": (("dp_shard_tp",), [[0, 1, 2, 3]] * 4),
                  "tensor": (("tp",), [[0, 1], [0, 1], [2, 3], [2, 3]])},
    "cp2_tp2": {"data": (RS, [[[0]], [[1]], [[2]], [[3]]]),
                "fsdp": (("dp_shard_cp",), [[0, 2], [1, 3], [0, 2], [1, 3]]),
                "expert_fsdp": (("dp_shard_cp_tp",), [[0, 1, 2, 3]] * 4),
                "context": (("cp",), [[0, 2], [1, 3], [0, 2], [1, 3]]),
                "tensor": (("tp",), [[0, 1], [0, 1], [2, 3], [2, 3]])},
}
# layout -> (data_rank of ranks 0..3, data_world)
DATA_RANKS = {name: ([0, 1, 2, 3], 4) for name in EXPECTED} | {
    "pp2_fsdp2": ([0, 1, 0, 1], 2), "fsdp2_cp2": ([0, 0, 1, 1], 2), "fsdp2_tp2": ([0, 0, 1, 1], 2),
    "cp2_tp2": ([0, 0, 0, 0], 1)}


def _sub_meshes(job: JobMesh) -> dict:
    experts = job.experts
    return {"data": job.data, "fsdp": job.fsdp, "expert_ep": experts and experts.ep,
            "expert_fsdp": experts and experts.fsdp, "pipeline": job.pipeline, "context": job.context,
            "tensor": job.tensor}


def _describe(mesh) -> tuple | None:
    """(dim names, ranks as nested lists, the ranks of each dim's process group)."""
    if mesh is None:
        return None
    groups = [dist.get_process_group_ranks(mesh.get_group(dim)) for dim in range(mesh.ndim)]
    return tuple(mesh.mesh_dim_names), mesh.mesh.tolist(), groups


def _worker():
    init_distributed(ParallelConfig())
    out = {}
    for name, dims in LAYOUTS.items():
        job = JobMesh.build(dims, "cpu")
        out[name] = ({sub: _describe(mesh) for sub, mesh in _sub_meshes(job).items()},
                     job.data_rank, job.data_world, job.rank, job.world)
    try:
        JobMesh.build(MeshDims(dp_shard=2), "cpu")
    except ConfigError as err:
        out["mismatch"] = str(err)
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_on_ranks(_worker, 4, timeout=300)


def _ranks_along(nested: list, coordinate: tuple[int, ...], dim: int) -> list[int]:
    """The ranks of a nested rank list along `dim` through `coordinate`."""
    out = []
    for index in range(len(_axis(nested, dim))):
        point = list(coordinate)
        point[dim] = index
        value = nested
        for i in point:
            value = value[i]
        out.append(value)
    return out


def _axis(nested: list, dim: int) -> list:
    for _ in range(dim):
        nested = nested[0]
    return nested


def _coordinate(nested, rank: int) -> tuple[int, ...]:
    if isinstance(nested, int):
        return () if nested == rank else None
    for index, item in enumerate(nested):
        found = _coordinate(item, rank)
        if found is not None:
            return (index, *found)
    return None


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_sub_mesh_holds_the_expected_ranks(ranks, layout):
    for rank, result in enumerate(ranks):
        described, data_rank, data_world, job_rank, job_world = result[layout]
        assert (job_rank, job_world) == (rank, 4)
        for sub in SUB_MESHES:
            expected = EXPECTED[layout].get(sub)
            if expected is None:
                assert described[sub] is None, (layout, sub, rank)
                continue
            names, nested, groups = described[sub]
            assert (names, nested) == (expected[0], expected[1][rank]), (layout, sub, rank)
            # every dim's process group is the mesh's ranks along that dim through this rank
            coordinate = _coordinate(nested, rank)
            assert groups == [_ranks_along(nested, coordinate, dim) for dim in range(len(names))], (layout, sub)
        assert (data_rank, data_world) == (DATA_RANKS[layout][0][rank], DATA_RANKS[layout][1])


def test_degrees_that_do_not_match_the_group_are_refused_in_one_line(ranks):
    assert all(r["mismatch"] == "world size 2 does not match the process group's 4 ranks" for r in ranks)


@pytest.mark.parametrize("parallel,world", [
    (ParallelConfig(dp_replicate=3), 4), (ParallelConfig(dp_replicate=2, dp_shard=3), 4),
    (ParallelConfig(ep=3), 4), (ParallelConfig(dp_replicate=2, ep=4), 4)])
def test_degrees_that_do_not_multiply_to_the_world_are_a_one_line_config_error(parallel, world):
    with pytest.raises(ConfigError) as err:
        MeshDims.from_config(parallel, world)
    assert "\n" not in str(err.value) and f"world size {world}" in str(err.value)


def test_bad_degrees_are_refused_in_one_line():
    for kwargs in ({"dp_shard": 2, "ep": 3}, {"tp": 0}):
        with pytest.raises(ConfigError) as err:
            MeshDims(**kwargs)
        assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="world size 2 needs an initialised process group") as err:
        JobMesh.build(MeshDims(dp_shard=2), "cpu")
    assert "\n" not in str(err.value)


def test_one_rank_without_a_group_has_no_root():
    job = JobMesh.from_config(ParallelConfig(), 1, "cpu")
    assert job.root is None and all(mesh is None for mesh in _sub_meshes(job).values())
    assert (job.rank, job.world, job.data_rank, job.data_world, job.describe()) == (0, 1, 0, 1, "none")


def test_one_rank_job_owns_its_group_and_leaves_a_callers_group_alone():
    assert not dist.is_initialized()
    with distributed_job(ParallelConfig(backend="gloo")) as job:
        assert dist.is_initialized() and dist.get_world_size() == 1
        described = {sub: _describe(mesh) for sub, mesh in _sub_meshes(job).items()}
        assert described["data"] == (RS, [[0]], [[0], [0]]) and described["fsdp"] == (S, [0], [[0]])
        assert all(described[sub] is None for sub in SUB_MESHES[2:])
        assert job.describe() == "(1, 1)"
    assert not dist.is_initialized()  # created by the job: destroyed with it
    with pytest.raises(ConfigError), distributed_job(ParallelConfig(backend="gloo", dp_replicate=2)):
        pass
    assert not dist.is_initialized()  # also when the mesh does not fit the world
    init_distributed(ParallelConfig(backend="gloo"))
    try:
        with owned_process_group():
            init_distributed(ParallelConfig(backend="gloo"))
        assert dist.is_initialized()  # the caller's group stays
    finally:
        dist.destroy_process_group()
