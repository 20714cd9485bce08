"""A quiet CPU for the tests that need one, across pytest-xdist workers.

Why: the suite runs in parallel workers, each with its own cluster. Most tests wait on Kafka's quota
windows and do not mind a neighbour. A few measure something that a busy CPU moves: rate accuracy
against Kafka's formula, latencies, CPU seconds. Those are marked ``quiet``. They all run on one
worker, one after another (one xdist group), and get the CPU in one of two ways:

- ``CpuPriority`` (where the run may make cgroups: as root, with the cpu controller): each worker and
  everything it starts (its brokers, proxies, clients) sits in a cgroup of its own. While a quiet test
  runs, its worker's group gets the largest CPU weight the kernel allows, so the kernel gives it all
  the CPU it asks for; the other workers go on in what it leaves. Their tests mostly wait anyway.
- ``Room`` otherwise: the quiet test runs with no other test beside it. Two ``flock`` files make a
  readers-writer lock that favours the writer: everyone passes through the gate to enter, and a
  quiet test keeps the gate while it waits for the room to empty, so new ordinary tests queue behind
  it instead of starving it. The kernel drops a dead worker's locks, so a crash never wedges the run.
  This costs the quiet tests' whole length in wall time, which the first way does not.

A worker that runs quiet tests back to back keeps its priority (or the room) between them.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from types import TracebackType
from typing import Protocol, Self

#: The markers' names, registered in pyproject.toml.
MARKER = "quiet"
SENSITIVE_MARKER = "cpu_sensitive"


class Need(IntEnum):
    """What a test needs of the CPU, from its markers."""

    ORDINARY = 0
    #: Its figure moves when the CPU is short (a rate a client must reach, a terminal that must
    #: redraw in time), but it may share the machine: its worker's weight is raised while it runs,
    #: and it stays in its module's group.
    SENSITIVE = 1
    #: Its figure needs a quiet CPU: the quiet group, one at a time, at the highest weight.
    QUIET = 2

    @classmethod
    def of(cls, marker_names: set[str]) -> Need:
        if MARKER in marker_names:
            return cls.QUIET
        return cls.SENSITIVE if SENSITIVE_MARKER in marker_names else cls.ORDINARY


class Guard(Protocol):
    """What a worker does around each test: ``CpuPriority`` or ``Room``."""

    def before(self, need: Need) -> None: ...

    def after(self, need: Need, next_need: Need) -> None: ...


@dataclass(frozen=True)
class _Knob:
    """One cgroup version's CPU weight: the file and its value for each ``Need`` (the kernel's
    default, 16 times it, the maximum)."""

    file: str
    weights: tuple[str, str, str]

    @property
    def normal(self) -> str:
        return self.weights[Need.ORDINARY]

    @property
    def highest(self) -> str:
        return self.weights[Need.QUIET]


_V1 = _Knob("cpu.shares", ("1024", "16384", "262144"))
_V2 = _Knob("cpu.weight", ("100", "1600", "10000"))
KNOBS = {knob.file: knob for knob in (_V1, _V2)}
_RUN_PREFIX = "kthrottle-tests-"


def _cpu_cgroup() -> tuple[Path, _Knob] | None:
    """This process's cgroup directory under the cpu controller, and its weight knob, if any."""
    try:
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
        memberships = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in mounts:
        fields = line.split()
        if " - " not in line:
            continue
        mount_point = fields[4]
        fstype, _source, options = line.split(" - ", 1)[1].split()[:3]
        if fstype == "cgroup" and "cpu" in options.split(","):
            for member in memberships:
                _id, controllers, path = member.split(":", 2)
                if "cpu" in controllers.split(","):
                    return Path(mount_point + path), _V1
        if fstype == "cgroup2":
            for member in memberships:
                if member.startswith("0::"):
                    here = Path(mount_point + member[3:])
                    controllers = (here / "cgroup.controllers")
                    if controllers.is_file() and "cpu" in controllers.read_text().split():
                        return here, _V2
    return None


class CpuPriority:
    """The run's cgroup with one child per worker (made by the xdist controller, joined by workers)."""

    def __init__(self, run_group: Path, knob: _Knob) -> None:
        self.run_group = run_group
        self.knob = knob
        self._mine: Path | None = None
        self.need = Need.ORDINARY

    @classmethod
    def create(cls) -> CpuPriority:
        """The controller makes the run's group; raises OSError (or RuntimeError) naming why it can't."""
        found = _cpu_cgroup()
        if found is None:
            raise RuntimeError("no cgroup cpu controller in /proc/self/mountinfo")
        parent, knob = found
        for stale in parent.glob(f"{_RUN_PREFIX}*"):  # left by a run that was killed: empty by now
            _remove(stale)
        run_group = Path(tempfile.mkdtemp(prefix=_RUN_PREFIX, dir=parent))
        try:
            if knob is _V2:
                if "cpu" not in (run_group / "cgroup.controllers").read_text().split():
                    (parent / "cgroup.subtree_control").write_text("+cpu")
                (run_group / "cgroup.subtree_control").write_text("+cpu")
            if not (run_group / knob.file).is_file() and knob is _V1:
                raise RuntimeError(f"{run_group} has no {knob.file}")
        except BaseException:
            _remove(run_group)
            raise
        return cls(run_group, knob)

    def join(self, worker: str) -> None:
        """Move this worker into a group of its own; what it starts from now on is born there."""
        mine = self.run_group / worker
        mine.mkdir(exist_ok=True)
        (mine / "cgroup.procs").write_text(f"{os.getpid()}\n")
        (mine / self.knob.file).write_text(self.knob.normal)
        self._mine = mine

    def set_need(self, need: Need) -> None:
        if self._mine is None or self.need == need:
            return
        (self._mine / self.knob.file).write_text(self.knob.weights[need])
        self.need = need

    def before(self, need: Need) -> None:
        """Around each test (``Guard``): the weight its need asks for."""
        self.set_need(need)

    def after(self, need: Need, next_need: Need) -> None:
        """Down to what the next test needs, if less (the same weight is kept between them)."""
        if next_need < need:
            self.set_need(next_need)

    def remove(self) -> None:
        _remove(self.run_group)


def _remove(group: Path) -> None:
    """rmdir the group and its children (a cgroup directory is removed with rmdir, bottom up)."""
    for child in sorted((p for p in group.glob("*/") if p.is_dir()), reverse=True):
        with contextlib.suppress(OSError):
            child.rmdir()
    with contextlib.suppress(OSError):
        group.rmdir()


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

    def before(self, need: Need) -> None:
        """Around each test (``Guard``): alone for a quiet test, shared otherwise."""
        self.enter(alone=need is Need.QUIET)

    def after(self, need: Need, next_need: Need) -> None:
        if not (need is next_need is Need.QUIET):
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
