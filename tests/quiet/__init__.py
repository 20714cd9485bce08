"""A quiet CPU for the tests that need one, across pytest-xdist workers.

Why: the suite runs in parallel workers, each with its own cluster. Most tests wait on Kafka's quota
windows and do not mind a neighbour. A few measure something that a busy CPU moves: rate accuracy
against Kafka's formula, latencies, CPU seconds. Those are marked ``quiet``. They all run on one
worker, one after another (one xdist group), and get the CPU in one of two ways, each a ``Way``
that the xdist controller sets up and each worker turns into its ``Guard``:

- ``cgroups.CpuPriority`` (where the run may make cgroups: as root, with the cpu controller): each
  worker and everything it starts sits in a cgroup of its own, and a quiet test's worker gets the
  largest CPU weight the kernel allows while it runs. A test marked ``alone`` (a latency) also has
  the room below.
- ``room.Room`` otherwise: the quiet test runs with no other test beside it (a writer-preferring
  readers-writer lock over two ``flock`` files). This costs the quiet tests' whole length in wall
  time, which the first way does not.

A worker that runs quiet tests back to back keeps its priority (or the room) between them.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from tests.quiet.cgroups import CpuPriority
from tests.quiet.need import ALONE_MARKER, MARKER, SENSITIVE_MARKER, Guard, Need, Way
from tests.quiet.room import Room, RoomWay

__all__ = ["ALONE_MARKER", "MARKER", "SENSITIVE_MARKER", "CpuPriority", "Guard", "Need", "PriorityWay",
           "Room", "RoomWay", "Way", "choose_way", "guard_for"]


class PriorityWay:
    """cgroup weights for every need, and the room for the tests that must be alone."""

    def __init__(self, priority: CpuPriority, room: RoomWay) -> None:
        self.priority = priority
        self.room = room

    def worker_input(self) -> dict[str, str]:
        return {**self.priority.worker_input(), **self.room.worker_input()}

    def describe(self) -> str:
        return f"{self.priority.describe()}; tests marked {ALONE_MARKER} ran with nothing beside them"

    def remove(self) -> None:
        self.priority.remove()
        self.room.remove()


class _Both:
    """A worker's guards in order: the weight first, then (maybe waiting) the room."""

    def __init__(self, *guards: Guard) -> None:
        self.guards = guards

    def collected(self, needs: frozenset[Need]) -> None:
        for guard in self.guards:
            guard.collected(needs)

    def before(self, need: Need) -> None:
        for guard in self.guards:
            guard.before(need)

    def after(self, need: Need, next_need: Need) -> None:
        for guard in reversed(self.guards):
            guard.after(need, next_need)

    def close(self) -> None:
        for guard in reversed(self.guards):
            guard.close()


def _room_directory() -> Path:
    return Path(tempfile.mkdtemp(prefix="kthrottle-room-"))


def choose_way() -> Way:
    """The controller's choice: CPU priority through a cgroup where the run may make one, else the room."""
    try:
        priority = CpuPriority.create()
    except (OSError, RuntimeError) as exc:
        return RoomWay(_room_directory(), why=str(exc))
    return PriorityWay(priority, RoomWay(_room_directory()))


def guard_for(worker_input: dict[str, object], worker: str) -> Guard:
    """A worker's side of the controller's ``Way`` (from ``Way.worker_input``)."""
    if CpuPriority.INPUT_KEY in worker_input:
        return _Both(CpuPriority.joined(worker_input, worker),
                     RoomWay.entered(worker_input, alone_from=Need.ALONE))
    return RoomWay.entered(worker_input)
