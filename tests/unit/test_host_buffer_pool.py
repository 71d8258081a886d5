"""HostBufferPool (moetrain.parallel.gloo_comms): reuses a buffer only once nothing references it.

The reference is the storage each handed-out tensor lives on: a buffer still held (the tensor
itself, or any view FSDP or gloo made of it) must never come back from `take`; a released one
must, so that steps stop paying fresh pages; sizes and dtypes never mix, and the pool stays bounded.
"""

from __future__ import annotations

import torch

from moetrain.parallel.gloo_comms import HostBufferPool, PointToPointReduceScatter

CPU = torch.device("cpu")


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_a_released_buffer_is_reused_and_a_held_one_never():
    pool = HostBufferPool(per_size=2)
    first = pool.take(1000, torch.float32, CPU)
    first_storage = _storage(first)
    view = first.view(10, 100)[3]  # as FSDP views its gather output
    del first
    second = pool.take(1000, torch.float32, CPU)
    assert _storage(second) != _storage(view)  # the view still holds the first buffer
    del view
    third = pool.take(1000, torch.float32, CPU)
    assert _storage(third) == first_storage  # released: reused, not a fresh allocation
    del third
    again = pool.take(1000, torch.float32, CPU)
    assert _storage(again) == first_storage and again.shape == (1000,) and again.dtype == torch.float32


def test_sizes_and_dtypes_do_not_mix_and_the_pool_is_bounded():
    pool = HostBufferPool(per_size=2)
    a = pool.take(64, torch.float32, CPU)
    b = pool.take(64, torch.bfloat16, CPU)
    c = pool.take(32, torch.float32, CPU)
    assert (a.dtype, b.dtype, c.numel()) == (torch.float32, torch.bfloat16, 32)
    held = [pool.take(64, torch.float32, CPU) for _ in range(3)]  # 4 alive, only 2 pooled
    assert len({_storage(t) for t in [a, *held]}) == 4
    assert len(pool._buffers[(64, torch.float32, CPU)]) == 2


def test_reduce_scatter_output_is_not_pooled():
    # The output becomes the sharded gradient: pooling it would keep every layer's gradient buffer.
    comm = PointToPointReduceScatter(HostBufferPool())
    reduce_input = comm.allocate((400,), dtype=torch.float32, device=CPU)
    output = comm.allocate((100,), dtype=torch.float32, device=CPU)
    pooled = {_storage(b) for bs in comm.pool._buffers.values() for b in bs}
    assert _storage(reduce_input) in pooled and _storage(output) not in pooled
