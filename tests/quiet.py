"""A room that tests share and that a test needing a quiet CPU takes alone, across pytest-xdist workers.

Why: the suite runs in parallel workers, each with its own cluster. Most tests wait on Kafka's quota
windows and do not mind a neighbour. A few measure something that a busy CPU moves: rate accuracy
against Kafka's formula, latencies, CPU seconds. Those are marked ``quiet``, and each worker holds
this room around every test it runs: shared for an ordinary test, exclusive for a quiet one.

Two ``flock`` files make a readers-writer lock that favours the writer: everyone passes through the
gate to enter, and a quiet test keeps the gate while it waits for the room to empty, so new ordinary
tests queue behind it instead of starving it. A worker that runs quiet tests back to back keeps the
room between them. The kernel drops a dead worker's locks, so a crash never wedges the run.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from types import TracebackType
from typing import Self

#: The marker's name, registered in pyproject.toml.
MARKER = "quiet"


class Room:
    """The lock files live in ``directory``, one per test run (the xdist controller makes it)."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._gate = os.open(directory / "gate.lock", os.O_RDWR | os.O_CREAT, 0o600)
        self._room = os.open(directory / "room.lock", os.O_RDWR | os.O_CREAT, 0o600)
        self.alone = False
        self.inside = False

    def enter(self, alone: bool) -> None:
        """Shared (``alone`` False) or exclusive; a worker already alone stays alone."""
        if self.inside:
            if self.alone == alone:
                return
            self.leave()
        fcntl.flock(self._gate, fcntl.LOCK_EX)
        if alone:
            fcntl.flock(self._room, fcntl.LOCK_EX)  # the gate stays shut until leave()
        else:
            try:
                fcntl.flock(self._room, fcntl.LOCK_SH)
            finally:
                fcntl.flock(self._gate, fcntl.LOCK_UN)
        self.alone = alone
        self.inside = True

    def leave(self) -> None:
        if not self.inside:
            return
        fcntl.flock(self._room, fcntl.LOCK_UN)
        if self.alone:
            fcntl.flock(self._gate, fcntl.LOCK_UN)
        self.inside = False
        self.alone = False

    def close(self) -> None:
        self.leave()
        os.close(self._gate)
        os.close(self._room)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, _t: type[BaseException] | None, _e: BaseException | None,
                 _tb: TracebackType | None) -> None:
        self.close()
