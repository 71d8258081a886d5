"""`moetrain lighthouse`: start torchft's lighthouse, the quorum server of a fault-tolerant HSDP run.

The replica groups of a run with `ft.enabled = true` ask it, every step, which groups take part
(a quorum): a group that stops heartbeating drops out after `--heartbeat-timeout-s`, and a
restarted group is let back in at the next step. The first line of stdout is the address the
groups pass as `--ft.lighthouse`; the process then serves until SIGTERM or SIGINT. This module
starts and stops the server; it knows nothing of training.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any, NoReturn

from moetrain.args import parse_typed_args
from moetrain.errors import ConfigError


@dataclass
class LighthouseOptions:
    """Start the lighthouse of a fault-tolerant HSDP run (torchft) and print its address."""

    min_replicas: int = 1
    """Replica groups a quorum needs (a step waits until this many have joined)."""
    join_timeout_s: float = 5.0
    """After the first group asks, how long to wait for the other live groups before forming a quorum without them."""
    heartbeat_timeout_s: float = 5.0
    """A group silent this long is treated as lost and left out of the next quorum."""
    bind: str = "[::]:29510"
    """HOST:PORT to listen on ([::]:0 = any free port; the address is printed either way)."""


def _checked(options: LighthouseOptions) -> LighthouseOptions:
    if options.min_replicas < 1:
        raise ConfigError(f"--min-replicas = {options.min_replicas} is invalid: must be >= 1")
    for name in ("join_timeout_s", "heartbeat_timeout_s"):
        value = getattr(options, name)
        if not 0 < value <= 86400:
            raise ConfigError(f"--{name.replace('_', '-')} = {value} is invalid: must be seconds in (0, 86400]")
    return options


def start_lighthouse(options: LighthouseOptions) -> Any:
    """The running server; ConfigError (one line) when it cannot listen on `options.bind`."""
    try:
        from torchft._torchft import LighthouseServer
    except ImportError:
        raise ConfigError("moetrain lighthouse needs torchft: pip install 'moetrain[ft]'") from None
    try:
        return LighthouseServer(bind=options.bind, min_replicas=options.min_replicas,
                                join_timeout_ms=int(options.join_timeout_s * 1000),
                                heartbeat_timeout_ms=int(options.heartbeat_timeout_s * 1000))
    except RuntimeError as err:
        raise ConfigError(f"--bind = {options.bind!r} cannot be served: {err}") from None


def main(argv: list[str]) -> NoReturn:
    options = _checked(parse_typed_args(LighthouseOptions, argv, "moetrain lighthouse"))
    server = start_lighthouse(options)
    print(server.address(), flush=True)  # the first line: what the groups pass as --ft.lighthouse
    stopped = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stopped.set())
    while not stopped.wait(1.0):
        pass
    server.shutdown()
    print("moetrain lighthouse: stopped", file=sys.stderr, flush=True)
    # The server's runtime threads can keep the interpreter from exiting after shutdown (seen here):
    # nothing is left to write, so end the process now.
    os._exit(0)
