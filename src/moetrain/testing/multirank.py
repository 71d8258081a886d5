"""Run a function on N gloo ranks as child processes, for tests and benchmarks.

`run_on_ranks(fn, world_size, *args)` starts N processes, each joining a gloo
process group on a free 127.0.0.1 port, runs `fn(*args)` on every rank and returns
the list of per-rank results. An exception on any rank fails the call with that
rank's traceback; a rank that does not finish within `timeout` (a hung collective,
say) fails it too. Every child is killed and reaped before this returns or raises.
`fn` must be importable (a module-level function) because it reaches the ranks pickled.

Ranks are spawned (a fresh interpreter each) unless `use_preloaded_fork_server()` was
called: then ranks of calls without `rank_env` are forked from one server process that
imported torch and the parent's moetrain modules once, which saves each rank those
imports (seconds per rank). A forked rank gets the parent's current environment,
working directory, sys.path, stdout and stderr as a spawned one would; it differs in
what only a fresh interpreter gives: a resident set that starts smaller (pages of the
server's libraries are not yet touched), the server's string hash seed on every rank,
and environment variables read when torch loads (those come from the server's start,
which is why `rank_env` calls always spawn). This module must not import the rest of moetrain:
it sits below every other layer.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from multiprocessing import forkserver, reduction
from multiprocessing.context import BaseContext
from typing import Any

import torch
import torch.distributed as dist

# The server imports these, and the moetrain modules the parent has loaded by its first call.
# Importing them starts no torch thread pool (those start with the first parallel op), so
# forking after them is safe; numpy's OpenBLAS pool stops itself around a fork.
_LIBRARY_PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
                  "torch.distributed.checkpoint", "torch._dynamo", "numpy")


class RankFailure(RuntimeError):
    """A rank raised, died or timed out; the message carries its traceback."""


class _ForkServer:
    """Whether ranks are forked from a preloaded server, and that server's one start."""

    def __init__(self) -> None:
        self.enabled = False
        self.started = False
        self.extra_preload: tuple[str, ...] = ()
        self.lock = threading.Lock()

    def context(self) -> BaseContext:
        """The forkserver context, its server started with the preload and this process's sys.path."""
        ctx = mp.get_context("forkserver")
        with self.lock:
            if not self.started:
                loaded = sorted(name for name in sys.modules if name.startswith("moetrain.")
                                and name != "moetrain.__main__")
                ctx.set_forkserver_preload([*_LIBRARY_PRELOAD, *self.extra_preload, "moetrain", *loaded])
                # The server resolves the preload with its own sys.path: make it this process's,
                # so that it imports the same moetrain as a rank that unpickles `fn` would.
                saved = {"PYTHONPATH": os.environ.get("PYTHONPATH")}
                os.environ["PYTHONPATH"] = os.pathsep.join(path for path in sys.path if path)
                try:
                    forkserver.ensure_running()
                finally:
                    _restore(saved)
                self.started = True
        return ctx


_FORK_SERVER = _ForkServer()


def use_preloaded_fork_server(extra_preload: tuple[str, ...] = ()) -> None:
    """Fork the ranks of later calls without `rank_env` from a server with torch already imported.

    `extra_preload`: more modules for the server to import, e.g. a test runner that every
    rank imports again (a missing one only costs the ranks its import).
    """
    _FORK_SERVER.enabled = True
    _FORK_SERVER.extra_preload = tuple(extra_preload)


class _ParentState:
    """What a forked rank takes from the parent at the call: environment, stdout and stderr.

    A spawned rank inherits these when it starts; a rank forked from the server would
    otherwise get the server's, frozen at the server's start.
    """

    def __init__(self, environ: dict[str, str], streams: tuple | None = None) -> None:
        self.environ = environ
        self.streams = streams

    def __reduce__(self):
        # Runs while the child is being started: DupFd hands the parent's descriptors over.
        return (_ParentState, (self.environ, (reduction.DupFd(1), reduction.DupFd(2))))

    def apply(self) -> None:
        os.environ.clear()
        os.environ.update(self.environ)
        for target, inherited in zip((1, 2), self.streams or ()):
            fd = inherited.detach()
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)
        numpy = sys.modules.get("numpy")
        if numpy is not None:  # a fresh interpreter seeds it from the OS; forked ones would share one state
            numpy.random.seed()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child(rank: int, world_size: int, port: int, fn: Callable, args: tuple, kwargs: dict,
           conn, backend: str, threads: int, parent: _ParentState) -> None:
    parent.apply()
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
    """Run `fn(*args, **kwargs)` on `world_size` ranks; return per-rank results.

    `rank_env`: environment variables the ranks start with (read before they import anything,
    e.g. allocator settings that torch reads when it loads); such ranks are always spawned.
    """
    ctx = _FORK_SERVER.context() if _FORK_SERVER.enabled and not rank_env else mp.get_context("spawn")
    port = free_port()
    pipes, procs = [], []
    saved = {name: os.environ.get(name) for name in rank_env or {}}
    try:
        os.environ.update(rank_env or {})  # a spawned child starts with the parent's environment
        parent = _ParentState(dict(os.environ))
        for rank in range(world_size):
            parent_conn, child_conn = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, daemon=True,
                               args=(rank, world_size, port, fn, args, kwargs, child_conn, backend,
                                     threads_per_rank, parent))
            proc.start()
            child_conn.close()
            pipes.append(parent_conn)
            procs.append(proc)
        _restore(saved)
        return _collect(pipes, procs, timeout)
    finally:
        _restore(saved)
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(timeout=10)
        for conn in pipes:
            conn.close()


def _collect(pipes: list, procs: list, timeout: float) -> list[Any]:
    """Every rank's result, or RankFailure for the first rank that raised, died or ran out of time."""
    world_size = len(procs)
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


def _restore(saved: dict[str, str | None]) -> None:
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
