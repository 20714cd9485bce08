"""CPU accounting from /proc, to tell "the proxy is slow" from "the machine is full".

On a small machine the brokers and the client already keep every core busy, so whatever CPU the
proxy takes comes out of their share: its cost per MB is the figure that travels between
machines, while the throughput ratio depends on how full this one is. Minor page faults are
counted too: a proxy that gets fresh memory from the kernel for every large frame spends more
time faulting pages in than copying them. Linux only; elsewhere every reading is None and the
bench prints no CPU figures.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class ProcessStat(NamedTuple):
    cpu_s: float
    minor_faults: int


def process_stat(pid: int) -> ProcessStat | None:
    """User plus system CPU time (fields 14, 15) and minor faults (field 10) of /proc/PID/stat."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split after its last ')'.
    fields = text.rsplit(")", 1)[1].split()
    return ProcessStat((int(fields[11]) + int(fields[12])) / _TICKS_PER_S, int(fields[7]))


def process_cpu_seconds(pid: int) -> float | None:
    stat = process_stat(pid)
    return None if stat is None else stat.cpu_s


class Ticks(NamedTuple):
    """Jiffies of all cores since boot, from the first line of /proc/stat."""

    total: int
    idle: int
    iowait: int


def machine_ticks() -> Ticks | None:
    try:
        with open("/proc/stat") as stat:
            values = [int(v) for v in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(values) < 5:
        return None
    return Ticks(sum(values), values[3], values[4])


def _shares(before: Ticks | None, after: Ticks | None) -> tuple[float | None, float | None]:
    """(busy, waiting on disk) shares of all cores' time between two readings.

    Disk wait is idle time too, but shown apart: a slow run with an idle machine and high
    iowait points at the disk, not at the proxy or the brokers' CPU.
    """
    if before is None or after is None or after.total <= before.total:
        return None, None
    span = after.total - before.total
    idle = after.idle - before.idle
    iowait = after.iowait - before.iowait
    return 1.0 - (idle + iowait) / span, iowait / span


def sample_busy(seconds: float = 1.0) -> float | None:
    """How busy the machine is right now, before the bench adds anything."""
    before = machine_ticks()
    time.sleep(seconds)
    return _shares(before, machine_ticks())[0]


class Usage(NamedTuple):
    process_cpu_s: float | None
    process_faults: int | None
    busy: float | None
    iowait: float | None


@dataclass(frozen=True, slots=True)
class CpuWindow:
    """Readings taken at the start of a timed run; `close` turns them into shares of the run."""

    pid: int
    process_start: ProcessStat | None
    machine_start: Ticks | None

    @classmethod
    def open(cls, pid: int) -> CpuWindow:
        return cls(pid, process_stat(pid), machine_ticks())

    def close(self) -> Usage:
        """What the process used (CPU seconds, minor faults) and the machine's shares since `open`."""
        end = process_stat(self.pid)
        start = self.process_start
        if end is None or start is None:
            return Usage(None, None, *_shares(self.machine_start, machine_ticks()))
        return Usage(end.cpu_s - start.cpu_s, end.minor_faults - start.minor_faults,
                     *_shares(self.machine_start, machine_ticks()))
