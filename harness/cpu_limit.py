"""A CPU quota on a process, from outside it: the overload bed's broker (issue 27).

A broker held to a fraction of a core by a cgroup CPU quota is the bottleneck of a loopback
cluster: what overloads is the broker, not the machine running the clients, so requests queue at
the broker as they do on a real cluster that is too small for its traffic.

The period is short (2 ms, not the kernel's 100 ms default): a throttled cgroup stops until the
next period starts, so a broker at its quota stalls every request that arrives meanwhile, for up
to the period less the quota's share of it spread over the machine's cores. That is the quota's
artefact, not a broker's queue, and a real broker on a slow CPU has no such stop. At 10 ms, gold's
slow requests on the overload bed took 9-11 ms again and again (one stall and its own turn) with
only 1-3 requests at the broker, above the issue's p99 target whatever the proxy did; at 2 ms a
stall is under 2 ms.

cgroup v1 (`cpu.cfs_quota_us`, `cpu.cfs_period_us`) and v2 (`cpu.max`) are both handled. The group
is made under the caller's own cpu cgroup, so a test worker's group (tests/quiet) still holds it.
Needs root; without it, or without a cpu controller, `CpuLimit` raises (a bed that silently does
not limit would measure the machine, not the broker).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from types import TracebackType

#: The quota's period (see the module's docstring).
PERIOD_US = 2_000


class CpuLimitError(RuntimeError):
    """The quota cannot be applied here (no cpu controller, or not root)."""


def cpu_cgroup() -> tuple[Path, int] | None:
    """This process's cgroup directory under the cpu controller, and the cgroup version (1 or 2);
    None without a cpu controller. The first mount that has one wins (tests/quiet/cgroups.py
    finds its workers' groups with it too)."""
    try:
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
        memberships = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in mounts:
        if " - " not in line:
            continue
        mount_point = line.split()[4]
        fstype, _source, options = line.split(" - ", 1)[1].split()[:3]
        if fstype == "cgroup" and "cpu" in options.split(","):
            for member in memberships:
                _id, controllers, path = member.split(":", 2)
                if "cpu" in controllers.split(","):
                    return Path(mount_point + path), 1
        if fstype == "cgroup2":
            for member in memberships:
                if member.startswith("0::"):
                    here = Path(mount_point + member[3:])
                    controllers = here / "cgroup.controllers"
                    if controllers.is_file() and "cpu" in controllers.read_text().split():
                        return here, 2
    return None


class CpuLimit:
    """Hold process `pid` (all its threads) to `cores` of CPU until `release` (or the `with` ends)."""

    def __init__(self, pid: int, cores: float, name: str, period_us: int = PERIOD_US) -> None:
        if not 0 < cores <= os.cpu_count():  # type: ignore[operator]
            raise ValueError(f"cores = {cores!r} must be in (0, {os.cpu_count()}]")
        self.pid = pid
        found = cpu_cgroup()
        if found is None:
            raise CpuLimitError("no cgroup cpu controller is mounted: the overload bed cannot hold a "
                                "broker to a fraction of a core")
        self._parent, self._version = found
        self.group = self._parent / f"{name}-{pid}"
        quota = int(cores * period_us)
        try:
            self.group.mkdir(exist_ok=True)
            if self._version == 1:
                (self.group / "cpu.cfs_period_us").write_text(str(period_us))
                (self.group / "cpu.cfs_quota_us").write_text(str(quota))
            else:
                (self.group / "cpu.max").write_text(f"{quota} {period_us}")
            (self.group / "cgroup.procs").write_text(str(pid))
        except PermissionError as e:
            raise CpuLimitError(f"cannot make cgroup {self.group} (the overload bed needs root): {e}") from e
        self.cores = cores

    def throttled_s(self) -> float:
        """How long the group has been held back by its quota, in seconds (the kernel's count)."""
        stat = (self.group / "cpu.stat").read_text().split()
        fields = dict(zip(stat[::2], stat[1::2], strict=False))
        if "throttled_time" in fields:  # v1: ns
            return int(fields["throttled_time"]) / 1e9
        return int(fields.get("throttled_usec", "0")) / 1e6

    def release(self) -> None:
        """Move the process back to the parent group and remove the quota's group."""
        with contextlib.suppress(ProcessLookupError, OSError):
            (self._parent / "cgroup.procs").write_text(str(self.pid))
        for _ in range(50):  # the kernel empties the group a moment after the move
            try:
                self.group.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.02)

    def __enter__(self) -> CpuLimit:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


__all__ = ["PERIOD_US", "CpuLimit", "CpuLimitError", "cpu_cgroup"]
