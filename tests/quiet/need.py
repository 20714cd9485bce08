"""What a test needs of the CPU (from its markers), and the two roles every way of giving it plays."""

from __future__ import annotations

from enum import IntEnum
from typing import Protocol

#: The markers' names, registered in pyproject.toml.
MARKER = "quiet"
SENSITIVE_MARKER = "cpu_sensitive"
ALONE_MARKER = "alone"


class Need(IntEnum):
    """What a test needs of the CPU, from its markers."""

    ORDINARY = 0
    #: Its figure moves when the CPU is short (a rate a client must reach, a terminal that must
    #: redraw in time), but it may share the machine: its worker's weight is raised while it runs,
    #: and it stays in its module's group.
    SENSITIVE = 1
    #: Its figure needs a quiet CPU: the quiet group, one at a time, at the highest weight.
    QUIET = 2
    #: Its figure is a latency, which even the highest weight moves (a waking thread still waits for
    #: the one running): nothing runs beside it. Also in the quiet group.
    ALONE = 3

    @classmethod
    def of(cls, marker_names: set[str]) -> Need:
        if ALONE_MARKER in marker_names:
            return cls.ALONE
        if MARKER in marker_names:
            return cls.QUIET
        return cls.SENSITIVE if SENSITIVE_MARKER in marker_names else cls.ORDINARY


class Guard(Protocol):
    """What a worker does around each test."""

    def collected(self, needs: frozenset[Need]) -> None:
        """What the run's tests need, once they are collected (before the first test)."""

    def before(self, need: Need) -> None: ...

    def after(self, need: Need, next_need: Need) -> None: ...

    def close(self) -> None: ...


class Way(Protocol):
    """The controller's side: made once per run, handed to each worker, removed at the end."""

    def worker_input(self) -> dict[str, str]: ...

    def describe(self) -> str: ...

    def remove(self) -> None: ...
