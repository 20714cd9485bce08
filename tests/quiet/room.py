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
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Self

from tests.quiet.need import Need

#: How long other tests wait for the ``alone`` tests to be done before going on regardless (the two
#: overload beds' tests take about 130 s each).
ALONE_FIRST_WAIT_S = 600.0


class Room:
    """The lock files live in ``directory``, one per test run (the xdist controller makes it).

    A test whose need is ``alone_from`` or more has the room to itself: every quiet test where the
    room is the only way, only ``Need.ALONE`` beside cgroup weights.
    """

    def __init__(self, directory: Path, alone_from: Need = Need.QUIET) -> None:
        self.alone_from = alone_from
        self._alone_done = directory / "alone-done"
        self._waits_for_alone = False
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

    def collected(self, needs: frozenset[Need]) -> None:
        """With ``alone`` tests in the run, the other tests wait for them to be done first."""
        self._waits_for_alone = Need.ALONE in needs

    def before(self, need: Need) -> None:
        """Around each test (``Guard``): alone from ``alone_from`` up, shared otherwise."""
        if self._waits_for_alone and need is not Need.ALONE:
            self._wait_for_alone_tests()
        self.enter(alone=need >= self.alone_from)

    def after(self, need: Need, next_need: Need) -> None:
        if need is Need.ALONE and next_need is not Need.ALONE:
            self._alone_done.touch()
            self._waits_for_alone = False
        if not (need >= self.alone_from and next_need >= self.alone_from):
            self.leave()

    def _wait_for_alone_tests(self) -> None:
        deadline = time.monotonic() + ALONE_FIRST_WAIT_S
        while not self._alone_done.exists():
            if time.monotonic() > deadline:
                print(f"the tests marked alone were not done within {ALONE_FIRST_WAIT_S:.0f} s "
                      f"({self._alone_done} is missing): going on", file=sys.stderr)
                break
            time.sleep(0.2)
        self._waits_for_alone = False

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
    """The controller's side (a ``Way``): the run's lock directory, and why there is no cgroup
    (None when a cgroup gives the CPU and the room only keeps the tests marked alone apart)."""

    INPUT_KEY = "kthrottle_quiet_room"

    def __init__(self, directory: Path, why: str | None = None) -> None:
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
