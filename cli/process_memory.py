"""The proxy process's memory, tuned for a relay of large frames: glibc's malloc and CPython's
cyclic collector (what `run` does once at start, and the housekeeping's trim after a spike)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import sys


def tune_malloc() -> None:
    """Keep freed memory in the process: the proxy buffers one frame at a time, often 1 MB or more,
    and glibc's default of returning such blocks to the kernel costs a page fault per 4 KB on every
    frame (measured by bench/cpu.py: ~780 faults per MB and half the proxy's CPU on consume)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    libc.mallopt(m_mmap_threshold, 64 * 1024 * 1024)
    libc.mallopt(m_trim_threshold, 256 * 1024 * 1024)
    libc.mallopt(m_top_pad, 64 * 1024 * 1024)


def trim_malloc() -> None:
    """Give freed memory back to the kernel (after a spike of large requests has passed)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)


def freeze_start_up_objects() -> None:
    """Leave what start-up made (modules, kafka-python's schema classes, the quota tables, the
    metrics registry: all kept for the process's life) out of the cyclic collector's full
    collections, which otherwise walk every one of them while the event loop waits. The imports
    alone are ~50,000 tracked objects: a full collection of them took 6.1 ms on an idle machine and
    none once frozen; on the overload bed one of a proxy's full collections took 26.5 ms (a pause
    for every connection it serves)."""
    gc.collect()
    gc.freeze()


__all__ = ["freeze_start_up_objects", "trim_malloc", "tune_malloc"]
