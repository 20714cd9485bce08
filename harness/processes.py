"""Child JVMs of the harness: free ports to give them (``ports``), their death with the test run,
their logs' tails.

Why a module of its own: the Kafka cluster and ZooKeeper start their JVMs the same way.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
from pathlib import Path

from .ports import free_ports

__all__ = ["LOG_TAIL_LINES", "die_with_parent", "free_ports", "tail"]

LOG_TAIL_LINES = 40
"""How much of a log a failure message quotes."""


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
