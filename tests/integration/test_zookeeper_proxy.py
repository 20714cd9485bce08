"""Proxies whose quotas live in a real ZooKeeper (Kafka's znode layout): set with kafka-configs
through one proxy, enforced by another; written straight into ZooKeeper the way Kafka's tools did;
and a ZooKeeper restart in the middle of traffic that loses no quota."""

from __future__ import annotations

import datetime
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from cli.quotas import alter, describe
from harness.local_kafka import LocalKafka
from harness.local_zookeeper import LocalZooKeeper

from .clients import wait_until
from .conftest import KafkaJava
from .proxies import QuotaProxy
from .test_quota_admin import RunningProducer, _throttles_running_producer, _topic, configs
from .zookeeper import kazoo_client, running_zookeeper, write_entity

UNKNOWN_SERVER_ERROR = -1


@pytest.fixture(scope="module")
def zookeeper() -> Iterator[LocalZooKeeper]:
    with running_zookeeper() as server:
        yield server


@pytest.fixture(scope="module")
def chroot() -> str:
    return f"/kafka-{uuid.uuid4().hex[:8]}"


def _zk_proxy(cluster: LocalKafka, workdir: Path, zookeeper: LocalZooKeeper, chroot: str) -> QuotaProxy:
    return QuotaProxy(
        cluster.bootstrap,
        workdir,
        f'zookeeper = "{zookeeper.connect_string}"\n'
        f'zookeeper_chroot = "{chroot}"\nquota_admins = ["User:ANONYMOUS"]\nquota_window_num = 5',
    )


@pytest.fixture(scope="module")
def zk_proxies(
    kafka_cluster: LocalKafka,
    zookeeper: LocalZooKeeper,
    chroot: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[QuotaProxy, QuotaProxy]]:
    """Two proxies sharing one ZooKeeper configuration."""
    first = _zk_proxy(kafka_cluster, tmp_path_factory.mktemp("zk-a"), zookeeper, chroot)
    second = _zk_proxy(kafka_cluster, tmp_path_factory.mktemp("zk-b"), zookeeper, chroot)
    try:
        yield first, second
    finally:
        first.stop()
        second.stop()


def test_quota_set_through_one_proxy_throttles_a_producer_on_another(
    zk_proxies: tuple[QuotaProxy, QuotaProxy], kafka_java: KafkaJava, zookeeper: LocalZooKeeper, chroot: str
) -> None:
    setter, enforcer = zk_proxies
    quota = 100_000
    _throttles_running_producer(
        enforcer,
        "zk-live",
        lambda: configs(
            kafka_java,
            setter.bootstrap,
            "--alter",
            "--add-config",
            f"producer_byte_rate={quota}",
            "--entity-type",
            "clients",
            "--entity-name",
            "zk-live",
        ),
        quota,
    )
    # Stored where Kafka kept it, as Kafka wrote it.
    with kazoo_client(zookeeper.connect_string) as kz:
        data, _ = kz.get(f"{chroot}/config/clients/zk-live")
    assert data == b'{"version":1,"config":{"producer_byte_rate":"100000"}}'
    assert describe(enforcer.bootstrap, client_id="zk-live") == [
        ({"client-id": "zk-live"}, {"producer_byte_rate": float(quota)})
    ]


def test_kafka_layout_written_into_zookeeper_is_live_within_a_second(
    zk_proxies: tuple[QuotaProxy, QuotaProxy], zookeeper: LocalZooKeeper, chroot: str
) -> None:
    """Timed by the proxies' own log lines ("quotas changed", written when the watch delivered the
    change), not by the admin client's describes: under a loaded run a describe's own start-up
    took over a second, which says nothing of ZooKeeper or the proxy."""
    with kazoo_client(zookeeper.connect_string) as kz:
        written = datetime.datetime.now()
        write_entity(kz, chroot, "users/CN%3Dcarol%2CO%3Dx/clients/app%201", {"consumer_byte_rate": "4096"})
        for proxy in zk_proxies:
            wait_until(
                lambda p=proxy: (
                    describe(p.bootstrap, user="CN=carol,O=x", client_id="app 1")
                    == [({"user": "CN=carol,O=x", "client-id": "app 1"}, {"consumer_byte_rate": 4096.0})]
                ),
                10,
                "the proxy to see the change",
                interval=0.05,
            )
        kz.delete(f"{chroot}/config/users/CN%3Dcarol%2CO%3Dx", recursive=True)
    took = [_applied_after(proxy.log(), written) for proxy in zk_proxies]
    shown = ", ".join(f"{t * 1000:.0f}" for t in took)
    print(f"\nZooKeeper write applied by the two proxies after {shown} ms")
    assert max(took) < 1.0
    for proxy in zk_proxies:
        wait_until(lambda p=proxy: describe(p.bootstrap, user="CN=carol,O=x") == [], 10, "the deletion")


def _applied_after(log: str, written: datetime.datetime) -> float:
    """Seconds from `written` to the first "quotas changed" line logged at or after it."""
    for line in log.splitlines():
        if ": quotas changed: " in line:
            at = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
            if at >= written - datetime.timedelta(milliseconds=1):
                return (at - written).total_seconds()
    raise AssertionError(f"no \"quotas changed\" line after {written}:\n{log[-2000:]}")


def test_zookeeper_restart_in_the_middle_of_traffic_loses_no_quota(
    zk_proxies: tuple[QuotaProxy, QuotaProxy], zookeeper: LocalZooKeeper, chroot: str
) -> None:
    setter, enforcer = zk_proxies
    quota = 100_000
    ((code, message),) = alter(
        setter.bootstrap, [({"client-id": "zk-restart"}, [("producer_byte_rate", float(quota), False)])]
    )
    assert code == 0, message
    wait_until(lambda: describe(enforcer.bootstrap, client_id="zk-restart") != [], 10, "the quota on both")
    producer = RunningProducer(enforcer.bootstrap, _topic(enforcer.bootstrap), "zk-restart")
    try:
        wait_until(lambda: len(producer.delivered) > 50, 60, "the producer to run")
        zookeeper.stop()
        stopped = time.monotonic()
        # While ZooKeeper is away the quota stays in force and visible, and changes are refused.
        ((code, message),) = alter(
            setter.bootstrap, [({"client-id": "zk-restart"}, [("producer_byte_rate", 1.0, True)])]
        )
        assert code == UNKNOWN_SERVER_ERROR and message and "ZooKeeper" in message, message
        time.sleep(max(0.0, 10 - (time.monotonic() - stopped)))
        during = producer.rate(stopped + 5, stopped + 10)
        assert describe(enforcer.bootstrap, client_id="zk-restart") == [
            ({"client-id": "zk-restart"}, {"producer_byte_rate": float(quota)})
        ]
        zookeeper.start()
        restarted = time.monotonic()
        # After the restart both proxies resynchronise: a change made now reaches them.
        wait_until(
            lambda: (
                alter(
                    setter.bootstrap,
                    [({"client-id": "zk-restart"}, [("producer_byte_rate", float(2 * quota), False)])],
                )
                == [(0, None)]
            ),
            30,
            "ZooKeeper writes to work again",
            interval=0.5,
        )
        wait_until(
            lambda: (
                describe(enforcer.bootstrap, client_id="zk-restart")
                == [({"client-id": "zk-restart"}, {"producer_byte_rate": float(2 * quota)})]
            ),
            10,
            "the raised quota",
        )
        resynced = time.monotonic() - restarted
    finally:
        producer.stop()
    print(
        f"\nZooKeeper down 10 s: producer at {during / 1e3:.1f} KB/s against {quota / 1e3:.0f} KB/s "
        f"meanwhile; writes and resync {resynced:.1f} s after the restart"
    )
    assert during <= 1.2 * quota
    assert enforcer.alive() and setter.alive()
    alter(setter.bootstrap, [({"client-id": "zk-restart"}, [("producer_byte_rate", 1.0, True)])])


def test_quota_tables_in_the_file_are_refused_when_zookeeper_is_set(
    kafka_cluster: LocalKafka, zookeeper: LocalZooKeeper, tmp_path: Path
) -> None:
    config = tmp_path / "kthrottle.toml"
    config.write_text(
        f'[proxy]\nzookeeper = "{zookeeper.connect_string}"\n\n'
        '[[quota]]\nclient_id = "x"\nproducer_byte_rate = 1024\n'
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "cli",
            "run",
            "--upstream",
            kafka_cluster.bootstrap,
            "--listen",
            "127.0.0.1:0",
            "--config",
            str(config),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2
    assert "proxy.zookeeper is set" in done.stderr, done.stderr
