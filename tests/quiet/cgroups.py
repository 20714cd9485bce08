"""Quiet tests beside the others, their worker's CPU weight raised: where the run may make cgroups.

Each worker and everything it starts (its brokers, proxies, clients) sits in a cgroup of its own.
While a quiet test runs, its worker's group gets the largest CPU weight the kernel allows, so the
kernel gives it all the CPU it asks for; the other workers go on in what it leaves. Their tests
mostly wait anyway. cgroup v1 (``cpu.shares``) and v2 (``cpu.weight``) are both handled.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Self

from harness.cpu_limit import cpu_cgroup
from tests.quiet.need import Need


@dataclass(frozen=True)
class _Knob:
    """One cgroup version's CPU weight: the file and its value for each ``Need`` (the kernel's
    default, 16 times it, the maximum)."""

    file: str
    weights: tuple[str, str, str, str]

    @property
    def normal(self) -> str:
        return self.weights[Need.ORDINARY]

    @property
    def highest(self) -> str:
        return self.weights[Need.ALONE]


_V1 = _Knob("cpu.shares", ("1024", "16384", "262144", "262144"))
_V2 = _Knob("cpu.weight", ("100", "1600", "10000", "10000"))
KNOBS = {knob.file: knob for knob in (_V1, _V2)}
_RUN_PREFIX = "kthrottle-tests-"


def _cpu_cgroup() -> tuple[Path, _Knob] | None:
    """This process's cgroup directory under the cpu controller, and its weight knob, if any."""
    found = cpu_cgroup()
    if found is None:
        return None
    here, version = found
    return here, _V1 if version == 1 else _V2


class CpuPriority:
    """The run's cgroup with one child per worker (made by the xdist controller, joined by workers).

    The controller's object is the ``Way``; a worker's (``joined``, or ``mine`` given) is its ``Guard``.
    """

    INPUT_KEY = "kthrottle_quiet_cgroup"
    KNOB_KEY = "kthrottle_quiet_knob"

    def __init__(self, run_group: Path, knob: _Knob, mine: Path | None = None) -> None:
        self.run_group = run_group
        self.knob = knob
        self.mine = mine
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

    def worker_input(self) -> dict[str, str]:
        return {self.INPUT_KEY: str(self.run_group), self.KNOB_KEY: self.knob.file}

    def describe(self) -> str:
        return f"quiet tests ran beside the others, their worker's CPU weight raised ({self.run_group})"

    @classmethod
    def joined(cls, worker_input: dict[str, object], worker: str) -> Self:
        """A worker's side: in its own group from now on; raises OSError naming why it can't."""
        priority = cls(Path(str(worker_input[cls.INPUT_KEY])), KNOBS[str(worker_input[cls.KNOB_KEY])])
        priority.join(worker)
        return priority

    def join(self, worker: str) -> None:
        """Move this process into a group of its own; what it starts from now on is born there."""
        mine = self.run_group / worker
        mine.mkdir(exist_ok=True)
        (mine / "cgroup.procs").write_text(f"{os.getpid()}\n")
        (mine / self.knob.file).write_text(self.knob.normal)
        self.mine = mine

    def set_need(self, need: Need) -> None:
        if self.mine is None or self.need == need:
            return
        (self.mine / self.knob.file).write_text(self.knob.weights[need])
        self.need = need

    def collected(self, needs: frozenset[Need]) -> None:
        """Nothing to prepare: weights are set test by test."""

    def before(self, need: Need) -> None:
        """Around each test (``Guard``): the weight its need asks for."""
        self.set_need(need)

    def after(self, need: Need, next_need: Need) -> None:
        """Down to what the next test needs, if less (the same weight is kept between them)."""
        if next_need < need:
            self.set_need(next_need)

    def close(self) -> None:
        """A worker leaves its group as it is: the controller removes the run's groups at the end."""

    def remove(self) -> None:
        _remove(self.run_group)


def _remove(group: Path) -> None:
    """rmdir the group and its children (a cgroup directory is removed with rmdir, bottom up)."""
    for child in sorted((p for p in group.glob("*/") if p.is_dir()), reverse=True):
        with contextlib.suppress(OSError):
            child.rmdir()
    with contextlib.suppress(OSError):
        group.rmdir()
