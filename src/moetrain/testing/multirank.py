"""Run a function on N gloo ranks as spawned processes, for tests and benchmarks.

`run_on_ranks(fn, world_size, *args)` spawns N processes, each joining a gloo
process group on a free 127.0.0.1 port, runs `fn(*args)` on every rank and returns
the list of per-rank results. An exception on any rank fails the call with that
rank's traceback; a rank that does not finish within `timeout` (a hung collective,
say) fails it too. Every child is killed and reaped before this returns or raises.
`fn` must be importable (a module-level function) because ranks are spawned.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist


class RankFailure(RuntimeError):
    """A rank raised, died or timed out; the message carries its traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child(rank: int, world_size: int, port: int, fn: Callable, args: tuple, kwargs: dict,
           conn, backend: str, threads: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                init_method=f"tcp://127.0.0.1:{port}")
        result = fn(*args, **kwargs)
    except BaseException:  # noqa: BLE001 - everything must reach the parent
        conn.send(("error", traceback.format_exc()))
    else:
        try:
            # Tearing down gloo while a peer is still inside its last collective can abort
            # that peer ("terminate called without an active exception"): leave together.
            dist.barrier()
            conn.send(("ok", result))
        except BaseException:  # noqa: BLE001 - a peer failed; its own error is the real one
            conn.send(("peer_lost", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    threads_per_rank: int = 1,
    rank_env: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` spawned ranks; return per-rank results.

    `rank_env`: environment variables the ranks start with (read before they import anything,
    e.g. allocator settings that torch reads when it loads).
    """
    ctx = mp.get_context("spawn")
    port = free_port()
    pipes, procs = [], []
    saved = {name: os.environ.get(name) for name in rank_env or {}}
    try:
        os.environ.update(rank_env or {})  # a spawned child starts with the parent's environment
        for rank in range(world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, daemon=True,
                               args=(rank, world_size, port, fn, args, kwargs, child_conn, backend,
                                     threads_per_rank))
            proc.start()
            child_conn.close()
            pipes.append(parent_conn)
            procs.append(proc)
        _restore(saved)
        results: list[Any] = [None] * world_size
        pending = set(range(world_size))
        deadline = time.monotonic() + timeout
        peer_lost: str | None = None  # a rank that lost a peer; wait briefly for the peer's own error
        while pending:
            for rank in sorted(pending):
                conn = pipes[rank]
                if conn.poll(0.05):
                    try:
                        status, payload = conn.recv()
                    except EOFError:
                        raise RankFailure(f"rank {rank} died (exit code {procs[rank].exitcode})") from None
                    if status == "error":
                        raise RankFailure(f"rank {rank} raised:\n{payload}")
                    if status == "peer_lost":
                        peer_lost = f"rank {rank} lost a peer after finishing:\n{payload}"
                        deadline = min(deadline, time.monotonic() + 5.0)
                    results[rank] = payload
                    pending.discard(rank)
                elif not procs[rank].is_alive() and not conn.poll(0):
                    raise RankFailure(f"rank {rank} died (exit code {procs[rank].exitcode})")
            if pending and time.monotonic() > deadline:
                raise RankFailure(peer_lost or f"ranks {sorted(pending)} did not finish within {timeout:.0f} s "
                                  "(hung collective?)")
        if peer_lost:
            raise RankFailure(peer_lost)
        for proc in procs:
            proc.join(timeout=10)
        return results
    finally:
        _restore(saved)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(timeout=10)
        for conn in pipes:
            conn.close()


def _restore(saved: dict[str, str | None]) -> None:
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
