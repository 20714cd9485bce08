"""Quiet tests alone: the fallback where the run cannot make cgroups (not root, no cpu controller).

Two ``flock`` files make a readers-writer lock that favours the writer: everyone passes through the
gate to enter, and a quiet test keeps the gate while it waits for the room to empty, so new ordinary
tests queue behind it instead of starving it. The kernel drops a dead worker's locks, so a crash
never wedges the run.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path
from types import TracebackType
from typing import Self

from tests.quiet.need import Need


class Room:
    """The lock files live in ``directory``, one per test run (the xdist controller makes it).

    A test whose need is ``alone_from`` or more has the room to itself: every quiet test where the
    room is the only way, only ``Need.ALONE`` beside cgroup weights.
    """

    def __init__(self, directory: Path, alone_from: Need = Need.QUIET) -> None:
        self.alone_from = alone_from
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

    def before(self, need: Need) -> None:
        """Around each test (``Guard``): alone from ``alone_from`` up, shared otherwise."""
        self.enter(alone=need >= self.alone_from)

    def after(self, need: Need, next_need: Need) -> None:
        if not (need >= self.alone_from and next_need >= self.alone_from):
            self.leave()

    def close(self) -> None:
        self.leave()
        os.close(self._gate)
        os.close(self._room)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, _t: type[BaseException] | None, _e: BaseException | None,
                 _tb: TracebackType | None) -> None:
        self.close()


class RoomWay:
    """The controller's side (a ``Way``): the run's lock directory, and why there is no cgroup."""

    INPUT_KEY = "kthrottle_quiet_room"

    def __init__(self, directory: Path, why: str) -> None:
        self.directory = directory
        self.why = why

    def worker_input(self) -> dict[str, str]:
        return {self.INPUT_KEY: str(self.directory)}

    @classmethod
    def entered(cls, worker_input: dict[str, object], alone_from: Need = Need.QUIET) -> Room:
        return Room(Path(str(worker_input[cls.INPUT_KEY])), alone_from)

    def describe(self) -> str:
        return f"quiet tests ran alone, the other workers waiting (no cgroup: {self.why})"

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
