"""Child JVMs of the harness: free ports to give them, their death with the test run, their logs' tails.

Why a module of its own: the Kafka cluster and ZooKeeper start their JVMs the same way.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import socket
from pathlib import Path

from .broker_config import HOST

LOG_TAIL_LINES = 40
"""How much of a log a failure message quotes."""


def free_ports(count: int) -> list[int]:
    """Ask the kernel for distinct free ports; all sockets stay open until every port is chosen."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Runs in the child before exec: the kernel SIGKILLs it when the spawning thread exits (Linux only).

    This is what keeps brokers from leaking when pytest itself is SIGKILLed and atexit never runs.
    """
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` of a log, or why it cannot be read."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"<cannot read {path}: {exc}>"
