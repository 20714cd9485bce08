"""Helpers for tests against a real ZooKeeper: a server fixture body, Kafka-style writes, a change recorder.

The writes here mimic Kafka 3.x's ``AdminZkClient`` with plain kazoo calls and hand-written JSON, on purpose
independent of ``config.zookeeper``: a test written with the code under test would agree with any mistake.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NodeExistsError

from harness.local_zookeeper import LocalZooKeeper
from quotas.engine import QuotaTable


@contextmanager
def running_zookeeper() -> Iterator[LocalZooKeeper]:
    """A started LocalZooKeeper, closed afterwards; a start failure fails the test loudly, never skips."""
    server = LocalZooKeeper()
    try:
        server.start()
    except RuntimeError as exc:
        server.close()
        pytest.fail(f"the local ZooKeeper did not start: {exc}", pytrace=False)
    try:
        yield server
    finally:
        server.close()


@contextmanager
def kazoo_client(hosts: str, timeout: float = 10.0) -> Iterator[KazooClient]:
    """A plain kazoo session for writing nodes the way Kafka's tools do."""
    client = KazooClient(hosts=hosts, timeout=timeout)
    client.start(timeout=timeout)
    try:
        yield client
    finally:
        client.stop()
        client.close()


def kafka_json(config: dict[str, str]) -> bytes:
    """``ConfigEntityZNode.encode``: Jackson's compact JSON of {"version":1,"config":{...}}."""
    return json.dumps({"version": 1, "config": config}, separators=(",", ":")).encode()


def write_entity(kz: KazooClient, chroot: str, entity_path: str, config: dict[str, str] | bytes) -> None:
    """``AdminZkClient.changeEntityConfig``: set or create (with parents) the node, then notify.

    ``entity_path`` is Kafka's sanitized path under /config, e.g. ``users/CN%3Dalice/clients/app``;
    ``config`` may be raw bytes to write invalid data.
    """
    path = f"{chroot}/config/{entity_path}"
    data = config if isinstance(config, bytes) else kafka_json(config)
    if kz.exists(path) is None:
        try:
            kz.create(path, data, makepath=True)
        except NodeExistsError:
            kz.set(path, data)
    else:
        kz.set(path, data)
    notification = json.dumps({"version": 2, "entity_path": entity_path}, separators=(",", ":")).encode()
    kz.create(f"{chroot}/config/changes/config_change_", notification, sequence=True, makepath=True)


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.01)


class Recorder:
    """An ``on_change`` callback that keeps every table with its arrival time and lets tests wait."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, QuotaTable]] = []
        self._cond = threading.Condition()

    def __call__(self, table: QuotaTable) -> None:
        with self._cond:
            self.calls.append((time.monotonic(), table))
            self._cond.notify_all()

    @property
    def latest(self) -> QuotaTable:
        with self._cond:
            assert self.calls, "on_change was never called"
            return self.calls[-1][1]

    def count(self) -> int:
        with self._cond:
            return len(self.calls)

    def wait_for(self, predicate: Callable[[QuotaTable], bool], timeout: float, what: str) -> float:
        """Wait until the latest table satisfies ``predicate``; return the monotonic time it arrived."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self.calls and predicate(self.calls[-1][1]):
                    return self.calls[-1][0]
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    last = self.calls[-1][1] if self.calls else None
                    raise AssertionError(
                        f"timed out after {timeout:g} s waiting for {what}; last table: {last}"
                    )
                self._cond.wait(remaining)
