"""The parallel run's plumbing: the quiet CPU (tests/quiet/), the port slices (harness/ports.py) and
the order of groups (tests/durations.py). Real processes and real sockets, no mocks: each is small."""

from __future__ import annotations

import itertools
import json
import multiprocessing
import socket
import threading
import time
from pathlib import Path

import pytest

from harness import ports
from tests import durations
from tests.quiet import CpuPriority, Need, Room, RoomWay, guard_for
from tests.quiet.cgroups import KNOBS

_CTX = multiprocessing.get_context("fork")


def _hold(directory: str, alone: bool, entered: multiprocessing.synchronize.Event,
          release: multiprocessing.synchronize.Event) -> None:
    room = Room(Path(directory))
    room.enter(alone=alone)
    entered.set()
    release.wait(30)
    room.close()


def _enter_within(directory: Path, alone: bool, seconds: float) -> bool:
    """Does a new process get in within `seconds`? (It is killed if not.)"""
    entered, release = _CTX.Event(), _CTX.Event()
    process = _CTX.Process(target=_hold, args=(str(directory), alone, entered, release))
    process.start()
    got_in = entered.wait(seconds)
    release.set()
    if not got_in:
        process.kill()  # still blocked in flock
    process.join(5)
    return got_in


def test_ordinary_tests_share_the_room(tmp_path: Path) -> None:
    with Room(tmp_path) as room:
        room.enter(alone=False)
        assert _enter_within(tmp_path, alone=False, seconds=5)


def test_without_cgroups_every_worker_locks_the_controllers_room(tmp_path: Path) -> None:
    way = RoomWay(tmp_path / "run", why="not root")
    guard = guard_for(way.worker_input(), "gw0")
    assert isinstance(guard, Room)
    guard.before(Need.QUIET)
    assert not _enter_within(way.directory, alone=False, seconds=0.5)  # the quiet test is alone
    guard.after(Need.QUIET, Need.ORDINARY)
    assert _enter_within(way.directory, alone=False, seconds=5)
    guard.close()
    assert way.describe().endswith("(no cgroup: not root)")
    way.remove()
    assert not way.directory.exists()


def test_beside_cgroup_weights_only_a_test_marked_alone_has_the_room_to_itself(tmp_path: Path) -> None:
    with Room(tmp_path, alone_from=Need.ALONE) as room:
        room.before(Need.QUIET)  # the weight gives it the CPU: others may still run
        assert _enter_within(tmp_path, alone=False, seconds=5)
        room.after(Need.QUIET, Need.ALONE)
        room.before(Need.ALONE)
        assert not _enter_within(tmp_path, alone=False, seconds=0.5)
        room.after(Need.ALONE, Need.QUIET)
        assert _enter_within(tmp_path, alone=False, seconds=5)


def test_other_tests_wait_for_the_alone_tests_to_be_done_first(tmp_path: Path) -> None:
    alone_worker, other_worker = Room(tmp_path, Need.ALONE), Room(tmp_path, Need.ALONE)
    for room in (alone_worker, other_worker):
        room.collected(frozenset({Need.ALONE, Need.QUIET, Need.ORDINARY}))
    started = threading.Event()
    other = threading.Thread(target=lambda: (other_worker.before(Need.ORDINARY), started.set()))
    other.start()
    try:
        alone_worker.before(Need.ALONE)  # does not wait for itself
        assert not started.wait(0.5)  # the ordinary test waits although the room is free to share
        alone_worker.after(Need.ALONE, Need.ALONE)
        assert not started.wait(0.3)  # another alone test follows
        alone_worker.after(Need.ALONE, Need.QUIET)
        assert started.wait(5)
    finally:
        other.join(5)
        alone_worker.close()
        other_worker.close()


def test_without_alone_tests_nobody_waits(tmp_path: Path) -> None:
    with Room(tmp_path, Need.ALONE) as room:
        room.collected(frozenset({Need.QUIET, Need.ORDINARY}))
        room.before(Need.ORDINARY)  # returns at once
        assert room.inside


def test_needs_come_from_the_markers() -> None:
    assert Need.of({"integration"}) is Need.ORDINARY
    assert Need.of({"cpu_sensitive", "integration"}) is Need.SENSITIVE
    assert Need.of({"quiet", "cpu_sensitive"}) is Need.QUIET
    assert Need.of({"quiet", "alone"}) is Need.ALONE


def test_a_quiet_test_waits_for_the_room_to_empty_and_then_has_it_alone(tmp_path: Path) -> None:
    with Room(tmp_path) as room:
        room.enter(alone=False)
        assert not _enter_within(tmp_path, alone=True, seconds=0.5)
        room.leave()
        assert _enter_within(tmp_path, alone=True, seconds=5)
        room.enter(alone=True)
        assert not _enter_within(tmp_path, alone=False, seconds=0.5)
        assert not _enter_within(tmp_path, alone=True, seconds=0.5)
    assert _enter_within(tmp_path, alone=False, seconds=5)


def test_a_waiting_quiet_test_shuts_the_gate_on_new_ordinary_ones(tmp_path: Path) -> None:
    """Writer preference: once a quiet test waits, a new ordinary test queues behind it."""
    with Room(tmp_path) as room:
        room.enter(alone=False)
        entered, release = _CTX.Event(), _CTX.Event()
        quiet = _CTX.Process(target=_hold, args=(str(tmp_path), True, entered, release))
        quiet.start()
        try:
            time.sleep(0.3)  # the quiet process now holds the gate and waits for the room
            assert not entered.is_set()
            assert not _enter_within(tmp_path, alone=False, seconds=0.5)
            room.leave()
            assert entered.wait(5)
        finally:
            release.set()
            quiet.join(5)


def test_a_dead_holder_leaves_the_room(tmp_path: Path) -> None:
    entered, release = _CTX.Event(), _CTX.Event()
    holder = _CTX.Process(target=_hold, args=(str(tmp_path), True, entered, release))
    holder.start()
    assert entered.wait(5)
    holder.kill()
    holder.join()
    assert _enter_within(tmp_path, alone=True, seconds=5)


def test_worker_slices_are_disjoint_and_below_the_ephemeral_range() -> None:
    whole = ports.whole_range()
    assert whole[1] == ports.ephemeral_low()
    slices = [ports.worker_slice(i, 4, whole) for i in range(4)]
    assert slices[0][0] == whole[0] and slices[-1][1] <= whole[1]
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(slices))
    with pytest.raises(ValueError, match="worker index 4"):
        ports.worker_slice(4, 4, whole)


def test_ports_come_from_the_slice_and_are_not_handed_out_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    # a window of this worker's own slice: another worker's ports are not this test's to take
    _low, high = ports.port_range()
    low = high - 400
    monkeypatch.setenv(ports.PORTS_ENV, f"{low}-{high}")
    got = ports.free_ports(10)
    assert len(set(got)) == 10 and all(low <= p < high for p in got)
    block = ports.free_port_block(5)
    assert not set(range(block, block + 5)) & set(got)
    with socket.create_server(("127.0.0.1", got[0])):
        assert not ports.port_free(got[0])


def test_threads_searching_at_once_are_never_handed_one_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fleet's members start from threads at once; two searches once picked one metrics port (h36)."""
    _low, high = ports.port_range()
    low = high - 1200
    monkeypatch.setenv(ports.PORTS_ENV, f"{low}-{high - 400}")  # beside the window the test above takes
    got: list[int] = []
    start = threading.Barrier(8)

    def pick() -> None:
        start.wait()
        for _ in range(40):
            got.append(ports.free_port_block(1))

    threads = [threading.Thread(target=pick) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(got) == 320 and len(set(got)) == 320, sorted(p for p in got if got.count(p) > 1)


def test_a_bad_port_range_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ports.PORTS_ENV, "12000")
    with pytest.raises(RuntimeError, match="KTHROTTLE_PORTS='12000' is not LO-HI"):
        ports.port_range()
    monkeypatch.setenv(ports.PORTS_ENV, "500-600")
    with pytest.raises(RuntimeError, match="need 1024 <= LO < HI"):
        ports.port_range()


def test_groups_cost_their_modules_and_unit_tests_sort_last(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    table = tmp_path / "durations.json"
    table.write_text(json.dumps({"a.py": 100.0, "b.py": 30.0}))
    monkeypatch.setattr(durations, "DURATIONS", table)
    monkeypatch.setattr(durations.load, "__defaults__", (table,))
    costs = durations.group_costs([("a.py", "a.py"), ("quiet", "a.py"), ("quiet", "b.py"),
                                   ("new.py", "new.py"), (None, "tests/unit/x.py")])
    assert costs == {"a.py": 100.0, "quiet": 130.0, "new.py": durations.UNKNOWN_MODULE_S,
                     None: durations.UNGROUPED_COST}


def test_the_table_is_rebuilt_from_a_junit_report(tmp_path: Path) -> None:
    report = tmp_path / "run.xml"
    report.write_text('<testsuites><testsuite>'
                      '<testcase classname="tests.durations" name="a" time="1.5"/>'
                      '<testcase classname="tests.durations" name="b" time="2.0"/>'
                      '<testcase classname="tests.unit.test_parallel_run.TestX" name="c" time="0.3"/>'
                      '<testcase classname="no.such.module" name="d" time="9"/>'
                      '</testsuite></testsuites>')
    assert durations.from_junit(report) == {"tests/durations.py": 3.5,
                                             "tests/unit/test_parallel_run.py": 0.3}


def _join_and_wait(run_group: str, knob: str, joined: multiprocessing.synchronize.Event,
                   release: multiprocessing.synchronize.Event) -> None:
    CpuPriority.joined(CpuPriority(Path(run_group), KNOBS[knob]).worker_input(), "gw7")
    joined.set()
    release.wait(30)


def test_a_worker_joins_its_own_cgroup_and_its_weight_is_raised_and_lowered() -> None:
    """Needs root and the cpu controller, as `make test` has here (else the run falls back to the room)."""
    priority = CpuPriority.create()
    joined, release = _CTX.Event(), _CTX.Event()
    worker = _CTX.Process(target=_join_and_wait,
                          args=(str(priority.run_group), priority.knob.file, joined, release))
    worker.start()
    try:
        assert joined.wait(10)
        group = priority.run_group / "gw7"
        assert str(worker.pid) in (group / "cgroup.procs").read_text().split()
        child = CpuPriority(priority.run_group, priority.knob, mine=group)  # seen from this process
        assert (group / priority.knob.file).read_text().strip() == priority.knob.normal
        child.before(Need.QUIET)
        assert (group / priority.knob.file).read_text().strip() == priority.knob.highest
        child.after(Need.QUIET, Need.QUIET)  # the next test is quiet too: kept
        assert (group / priority.knob.file).read_text().strip() == priority.knob.highest
        child.after(Need.QUIET, Need.SENSITIVE)
        weight = int((group / priority.knob.file).read_text())
        assert int(priority.knob.normal) < weight < int(priority.knob.highest)
        child.after(Need.SENSITIVE, Need.ORDINARY)
        assert (group / priority.knob.file).read_text().strip() == priority.knob.normal
    finally:
        release.set()
        worker.join(10)
        priority.remove()
    assert not priority.run_group.exists()
