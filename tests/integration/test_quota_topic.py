"""Quotas kept in a compacted topic of the upstream cluster (issue 26), with real processes.

Every member is a real `kthrottle run` with `quota_store = "kafka"`, each with a config directory
of its own as on separate hosts, sharing only the fleet secret. Changes go in with Kafka's own
`kafka-configs` (and `kthrottle quotas`) through one member and are read back through the others;
the topic is read with a plain consumer and written with a plain producer (a forged record). The
outage is a whole cluster stopped with SIGSTOP from outside.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from kafka.protocol.admin.client_quotas import (
    AlterClientQuotasRequest,
    AlterClientQuotasResponse,
    DescribeClientQuotasRequest,
    DescribeClientQuotasResponse,
)

from cli.quotas import alter, describe
from harness.local_kafka import SASL_USERS, TEST_HEAP_MB, LocalKafka
from harness.ports import free_udp_port
from protocol.frames import frame
from protocol.headers import encode_request_header

from .clients import wait_until
from .conftest import KafkaJava
from .fuzz import _read_frame
from .proxies import REPO, free_port_block
from .quota_runs import report
from .test_fleet import GreedyProducer, Member, assert_each_record_once
from .test_quota_admin import configs
from .test_quotas import _topic

#: The two tests that measure a producer's rate against the quota are `quiet` (tests/quiet/): they
#: run one at a time at the highest CPU weight, and the rest of the module adds little load beside
#: the other workers' rate tests.

SETTINGS = 'quota_store = "kafka"\nquota_admins = ["User:ANONYMOUS"]'
QUOTA = 1_000_000  # bytes per second over the fleet, as in test_fleet
RUN_S = 30.0
#: the fleet's produce capacity set through the topic, then doubled; each held for this long
CAPACITY = 500_000
CAPACITY_PHASE_S = 14.0
SKIPPED = "kthrottle_quota_records_skipped_total"


@pytest.fixture(scope="module")
def lone_cluster() -> Iterator[LocalKafka]:
    """A one-broker cluster of this module's own, to stop (SIGSTOP) without touching the worker's
    shared one; with Kafka's StandardAuthorizer, for a principal it refuses (plaintext clients are
    super users there)."""
    with LocalKafka(brokers=1, sasl=True, heap_mb=TEST_HEAP_MB, light_jit=True, authorizer=True) as cluster:
        yield cluster


class KafkaFleet:
    """Members with `quota_store = "kafka"` and `membership = "kafka"`, each in a directory of its
    own; started again on the same UDP ports."""

    def __init__(self, stack: ExitStack, bootstrap: str, root: Path, count: int, *, settings: str = SETTINGS,
                 plane: str = "", upstream_tls: str = "") -> None:
        """`plane`: more `[control_plane]` lines; `upstream_tls`: an `[upstream_tls]` table."""
        self.stack = stack
        self.bootstrap = bootstrap
        self.settings, self.plane, self.upstream_tls = settings, plane, upstream_tls
        self.topic = f"__kthrottle_quotas-{uuid.uuid4().hex[:8]}"
        self.name = f"topic-fleet-{uuid.uuid4().hex[:8]}"  # its group: kthrottle-fleet.<name>
        self.ports = [free_udp_port() for _ in range(count)]
        self.dirs = [root / f"host-{i}" for i in range(count)]
        secret = os.urandom(32).hex() + "\n"
        for workdir in self.dirs:
            workdir.mkdir()
            (workdir / "fleet.secret").write_text(secret)
        self.members: list[Member] = []

    def start(self) -> list[Member]:
        def one(index: int) -> Member:
            plane = f'[control_plane]\nquota_topic = "{self.topic}"\n{self.plane}\n'
            return Member(self.bootstrap, self.dirs[index], plane, udp_port=self.ports[index],
                          fleet='membership = "kafka"', name=self.name, settings=self.settings,
                          upstream_tls=self.upstream_tls)

        with ThreadPoolExecutor(len(self.ports)) as pool:
            self.members = list(pool.map(one, range(len(self.ports))))
        for member in self.members:
            self.stack.callback(member.stop)
        return self.members


def produce_rate_of(member: Member, client_id: str) -> float | None:
    """The producer_byte_rate a describe through `member` shows for the client id, or None."""
    for entity, values in describe(member.bootstrap, client_id=client_id):
        if entity == {"client-id": client_id}:
            return values.get("producer_byte_rate")
    return None


def seconds_until(condition: Callable[[], bool], timeout: float) -> float | None:
    """How long until `condition` held (polled every 20 ms), or None within `timeout`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if condition():
            return time.monotonic() - start
        time.sleep(0.02)
    return None


def topic_records(bootstrap: str, topic: str) -> list[tuple[bytes, bytes | None, dict[str, bytes]]]:
    """Every record of the quota topic: (key, value, headers), read with a plain consumer."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap.split(","), group_id=None, enable_auto_commit=False)
    try:
        partition = TopicPartition(topic, 0)
        consumer.assign([partition])
        consumer.seek_to_beginning(partition)
        end = consumer.end_offsets([partition])[partition]
        out = []
        deadline = time.monotonic() + 20
        while consumer.position(partition) < end and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=500).values():
                out += [(r.key, r.value, dict(r.headers or [])) for r in records]
        return out
    finally:
        consumer.close()


def topic_layout(bootstrap: str, topic: str) -> tuple[int, int, dict[str, str]]:
    """(partitions, replicas of partition 0, the configs set on it) of a topic, from the brokers."""
    from kafka import KafkaAdminClient
    from kafka.admin import ConfigResource, ConfigResourceType

    admin = KafkaAdminClient(bootstrap_servers=bootstrap.split(","))
    try:
        (described,) = admin.describe_topics([topic])
        found = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, topic)])  # those set
        configs = {name: str(entry["value"]) for name, entry in found["topic"][topic].items()}
    finally:
        admin.close()
    partitions = described["partitions"]
    return len(partitions), len(partitions[0]["replica_nodes"]), configs


@pytest.mark.quiet
def test_a_change_through_one_member_is_enforced_by_the_others(kafka_cluster: LocalKafka,
                                                               kafka_java: KafkaJava, tmp_path: Path) -> None:
    """kafka-configs through A; a describe through B and C shows it within 1 s; a producer through C
    is held to it; the topic holds one record per entity in Kafka's config form."""
    client = "topic-held"
    with ExitStack() as stack:
        fleet = KafkaFleet(stack, kafka_cluster.bootstrap, tmp_path, 3)
        a, b, c = fleet.start()
        for member in (a, b, c):
            wait_until(lambda m=member: m.metric("kthrottle_fleet_members") == 3, 15, "3 members")
        configs(kafka_java, a.bootstrap, "--alter", "--add-config", f"producer_byte_rate={QUOTA}",
                "--entity-type", "clients", "--entity-name", client)
        shown = [seconds_until(lambda m=m: produce_rate_of(m, client) == QUOTA, 10) for m in (b, c)]
        # Timed from the answer itself: kthrottle quotas returns as the answer arrives (the JVM's
        # exit would add its own time to kafka-configs').
        assert alter(a.bootstrap, [({"client-id": client}, [("producer_byte_rate", 2 * QUOTA, False)])]) == [
            (0, None)]
        timed = [seconds_until(lambda m=m: produce_rate_of(m, client) == 2 * QUOTA, 10) for m in (b, c)]
        assert alter(a.bootstrap, [({"client-id": client}, [("producer_byte_rate", QUOTA, False)])]) == [
            (0, None)]
        wait_until(lambda: all(produce_rate_of(m, client) == QUOTA for m in (a, b, c)), 5, "the quota back")
        report(f"quota topic, 3 members: kafka-configs --alter through A shown by a describe through B and C "
               f"{shown[0]:.2f} s and {shown[1]:.2f} s after the tool returned; kthrottle quotas through A "
               f"shown through B and C {timed[0]:.2f} s and {timed[1]:.2f} s after its answer"
               if None not in shown + timed else f"not shown: {shown} {timed}")
        assert None not in shown and None not in timed, (shown, timed)
        assert max(shown + timed) <= 1.0, (shown, timed)  # type: ignore[type-var]

        topic = _topic(c.bootstrap, "topic-held")
        started = time.monotonic()
        producer = GreedyProducer(c.bootstrap, topic, started, client_id=client)
        stack.callback(producer.stop, True)
        time.sleep(RUN_S)
        producer.stop()
        rate = producer.result.rate(RUN_S - 20, RUN_S)
        report(f"quota topic: a producer through C held to the quota set through A: {rate:,.0f} B/s over the "
               f"last 20 s of {RUN_S:.0f} ({rate / QUOTA:.3f}x {QUOTA:,} B/s)")
        assert 0.9 * QUOTA <= rate <= 1.1 * QUOTA, f"{rate:,.0f} B/s against {QUOTA:,}"
        assert_each_record_once(c.bootstrap, topic, [producer])
        assert c.metric("kthrottle_throttles_total", quota="producer_byte_rate", user="",
                        client_id=client) > 0

        partitions, replicas, topic_configs = topic_layout(kafka_cluster.bootstrap, fleet.topic)
        assert (partitions, replicas) == (1, 3), (partitions, replicas)
        assert topic_configs["cleanup.policy"] == "compact" and topic_configs["min.insync.replicas"] == "2"
        records = topic_records(kafka_cluster.bootstrap, fleet.topic)
        latest = {key: value for key, value, _ in records}
        assert latest[f"clients/{client}".encode()] is not None
        assert json.loads(latest[f"clients/{client}".encode()] or b"") == {
            "version": 1, "config": {"producer_byte_rate": str(QUOTA)}}, latest
        assert all("kthrottle-mac" in headers for _, _, headers in records)


def test_over_sasl_ssl_with_the_proxys_own_login(kafka_cluster: LocalKafka, tmp_path: Path) -> None:
    """In front of the SASL_SSL listener: the members reach the topic and the group with
    [control_plane]'s SCRAM login over [upstream_tls]; an admin authenticated by the brokers
    changes a quota through one, and the other enforces it."""
    assert kafka_cluster.sasl_ssl_bootstrap and kafka_cluster.certificates is not None
    tls = f'[upstream_tls]\nca = "{kafka_cluster.certificates.ca}"\n\n'
    plane = ('sasl_mechanism = "SCRAM-SHA-512"\nsasl_username = "admin"\n'
             f'sasl_password = "{SASL_USERS["admin"]}"')
    login = {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "PLAIN", "sasl_plain_username": "admin",
             "sasl_plain_password": SASL_USERS["admin"]}
    with ExitStack() as stack:
        fleet = KafkaFleet(stack, kafka_cluster.sasl_ssl_bootstrap, tmp_path, 2, plane=plane,
                           upstream_tls=tls, settings='quota_store = "kafka"\nquota_admins = ["User:admin"]')
        a, b = fleet.start()
        for member in (a, b):
            wait_until(lambda m=member: m.metric("kthrottle_fleet_peer_addresses") == 1, 15,
                       "2 members listed")
        entry = [({"client-id": "over-tls"}, [("producer_byte_rate", 4321.0, False)])]
        assert alter(a.bootstrap, entry, **login) == [(0, None)]
        shown = seconds_until(lambda: any(v.get("producer_byte_rate") == 4321.0 for e, v in
                                          describe(b.bootstrap, client_id="over-tls", **login)), 10)
        report(f"quota topic over SASL_SSL with the proxy's SCRAM login: a change through A shown through "
               f"B {shown} s after")
        assert shown is not None and shown <= 1.0, shown
        refused = alter(a.bootstrap, entry, security_protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN",
                        sasl_plain_username="alice", sasl_plain_password=SASL_USERS["alice"])
        assert refused[0][0] == 31, refused  # CLUSTER_AUTHORIZATION_FAILED: alice is no quota admin


def test_two_admins_changing_one_entity_at_once_end_with_one_value(kafka_cluster: LocalKafka,
                                                                   tmp_path: Path) -> None:
    """Admins on two members set one entity's quota at the same moment, 10 times: the topic's order
    decides, and every member ends with the value of the entity's last record."""
    from concurrent.futures import ThreadPoolExecutor as Pool

    rounds = 10
    with ExitStack() as stack:
        fleet = KafkaFleet(stack, kafka_cluster.bootstrap, tmp_path, 3)
        members = fleet.start()
        with Pool(2) as pool:
            for round_ in range(rounds):
                answers = list(pool.map(
                    lambda m, v: alter(m.bootstrap, [({"client-id": "raced"},
                                                      [("producer_byte_rate", v, False)])]),
                    members[:2], [1000.0 + round_, 2000.0 + round_]))
                assert answers == [[(0, None)], [(0, None)]], answers
        last = json.loads([v for k, v, _ in topic_records(kafka_cluster.bootstrap, fleet.topic)
                           if k == b"clients/raced"][-1] or b"")["config"]["producer_byte_rate"]
        wait_until(lambda: {produce_rate_of(m, "raced") for m in members} == {float(last)}, 5,
                   f"every member at the last record's value {last}")
        winners = {produce_rate_of(m, "raced") for m in members}
        report(f"quota topic: 2 admins on 2 members changing one entity at once, {rounds} times: all 3 "
               f"members end at {winners}, the last record's value")


@pytest.mark.quiet
def test_the_capacity_set_in_the_topic_applies_to_every_member_while_they_run(kafka_cluster: LocalKafka,
                                                                             tmp_path: Path) -> None:
    """`kthrottle capacity set` with member A's config file: B applies the capacity within a second,
    a greedy producer through B (no quota of its own) is held to it, then to a doubled one;
    `delete` takes it away again. No member restarts."""
    capacity_metric = "kthrottle_capacity"
    with ExitStack() as stack:
        fleet = KafkaFleet(stack, kafka_cluster.bootstrap, tmp_path, 2)
        a, b = fleet.start()

        def capacity(*args: str) -> str:
            done = subprocess.run([sys.executable, "-m", "cli", "capacity", "--config", str(a.config_path),
                                   "--upstream", kafka_cluster.bootstrap, *args],
                                  cwd=REPO, capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stdout + done.stderr
            return done.stdout

        topic = _topic(b.bootstrap, "topic-capacity")
        rates: list[tuple[float, float, float]] = []
        started = time.monotonic()
        producer: GreedyProducer | None = None
        for limit in (CAPACITY, 2 * CAPACITY):
            assert f"produce_byte_rate = {limit}" in capacity("set", f"produce_byte_rate={limit}")
            applied = seconds_until(
                lambda lim=limit: b.metric(capacity_metric, quota="producer_byte_rate") == lim, 10)
            if producer is None:
                producer = GreedyProducer(b.bootstrap, topic, started, client_id="capacity-free")
                stack.callback(producer.stop, True)
            phase = time.monotonic() - started
            time.sleep(CAPACITY_PHASE_S)
            rates.append((limit, applied or -1.0, producer.result.rate(phase + 6, phase + CAPACITY_PHASE_S)))
        assert producer is not None
        producer.stop()
        assert "no capacity in the quota topic" in capacity("delete")
        removed = seconds_until(lambda: b.metric(capacity_metric, quota="producer_byte_rate") == 0.0, 10)
        report("capacity in the quota topic, set with `kthrottle capacity` through A's config: "
               + "; ".join(f"{limit:,.0f} B/s applied on B after {applied:.2f} s, a producer through B "
                           f"{rate:,.0f} B/s ({rate / limit:.3f}x)" for limit, applied, rate in rates)
               + f"; deleted: gone from B after {removed if removed is None else round(removed, 2)} s")
        for limit, applied, rate in rates:
            assert 0 <= applied <= 1.0, rates
            assert 0.85 * limit <= rate <= 1.15 * limit, rates
        assert removed is not None and removed <= 1.0
        assert b.metric("kthrottle_throttles_total", quota="producer_byte_rate", user="",
                        client_id="capacity-free") == 0, "the quota did not throttle: the capacity did"


def test_restarted_members_have_the_quotas_before_serving(kafka_cluster: LocalKafka, tmp_path: Path) -> None:
    """All three killed with -9 and started again: each has read the topic before its listener
    opens (and has rejoined the group, whose dead members the coordinator drops at their session
    timeout)."""
    with ExitStack() as stack:
        fleet = KafkaFleet(stack, kafka_cluster.bootstrap, tmp_path, 3)
        a, _, _ = fleet.start()
        entries = [({"client-id": f"kept-{i}"}, [("producer_byte_rate", 1000.0 * (i + 1), False)])
                   for i in range(3)]
        entries.append(({"user": "kept-user"},
                        [("consumer_byte_rate", 5000.0, False), ("share", 3.0, False)]))
        entries.append(({"ip": "127.0.0.9"}, [("connection_creation_rate", 7.0, False)]))
        assert alter(a.bootstrap, entries) == [(0, None)] * len(entries)
        for member in fleet.members:
            member.kill()
        restarted = time.monotonic()
        members = fleet.start()
        back = time.monotonic() - restarted
        for member in members:
            log = member.log()
            read = log.find("entities read up to offset")
            assert 0 <= read < log.find("bootstrap.servers="), log[-3000:]
            assert "5 entities read" in log, log[-3000:]
            shown = {json.dumps(e, sort_keys=True): v for e, v in describe(member.bootstrap)}
            assert shown == {
                '{"client-id": "kept-0"}': {"producer_byte_rate": 1000.0},
                '{"client-id": "kept-1"}': {"producer_byte_rate": 2000.0},
                '{"client-id": "kept-2"}': {"producer_byte_rate": 3000.0},
                '{"user": "kept-user"}': {"consumer_byte_rate": 5000.0, "share": 3.0},
                '{"ip": "127.0.0.9"}': {"connection_creation_rate": 7.0},
            }, shown
        report("quota topic: 3 members killed with -9 and started again: each read the topic's 5 entities "
               f"before opening its listener, all 3 serving {back:.1f} s after the restart began")


def test_a_forged_record_is_skipped_logged_and_counted(kafka_cluster: LocalKafka, tmp_path: Path) -> None:
    """A record written straight to the topic with a plain producer, without the fleet's MAC (and one
    with a MAC from another secret) changes nothing on any member."""
    from kafka import KafkaProducer

    with ExitStack() as stack:
        fleet = KafkaFleet(stack, kafka_cluster.bootstrap, tmp_path, 2)
        a, b = fleet.start()
        real = [({"client-id": "real"}, [("producer_byte_rate", 1234.0, False)])]
        assert alter(a.bootstrap, real) == [(0, None)]
        producer = KafkaProducer(bootstrap_servers=kafka_cluster.bootstrap.split(","))
        try:
            forged = json.dumps({"version": 1, "config": {"producer_byte_rate": "999999999"}}).encode()
            producer.send(fleet.topic, key=b"clients/real", value=forged).get(timeout=10)
            producer.send(fleet.topic, key=b"clients/forged", value=forged,
                          headers=[("kthrottle-written-at", struct.pack(">q", int(time.time() * 1000))),
                                   ("kthrottle-mac", os.urandom(32))]).get(timeout=10)
        finally:
            producer.close()
        for member in (a, b):
            wait_until(lambda m=member: m.metric(SKIPPED, reason="forged") == 2, 10,
                       "two forged records counted")
            member.wait_for_log("forged", 5)
            assert {json.dumps(e): v for e, v in describe(member.bootstrap)} == {
                '{"client-id": "real"}': {"producer_byte_rate": 1234.0}}
        log = a.log()
        lines = [line for line in log.splitlines() if "skipped a record" in line]
        report("quota topic: forged records skipped: "
               + "; ".join(line.split("skipped a record: ")[-1] for line in lines))
        assert len(lines) == 2 and all("forged" in line for line in lines), lines


def _raw(bootstrap: str, api_key: int, request: Any) -> bytes:
    """One v0 admin request on a bare socket, the response body: no ApiVersions or Metadata first,
    which a stopped cluster would never answer (the proxy answers these requests itself)."""
    host, port = bootstrap.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(frame(encode_request_header(api_key, 0, 7, "raw-admin") + bytes(request.encode())))
        return _read_frame(sock)[4:]  # after the correlation id


def _alter_raw(bootstrap: str, client_id: str, rate: float) -> tuple[int, str | None]:
    a = AlterClientQuotasRequest
    request = a[0](entries=[a.EntryData(
        entity=[a.EntryData.EntityData(entity_type="client-id", entity_name=client_id)],
        ops=[a.EntryData.OpData(key="producer_byte_rate", value=rate, remove=False)])], validate_only=False)
    (entry,) = AlterClientQuotasResponse[0].decode(_raw(bootstrap, 49, request)).entries
    return entry.error_code, entry.error_message


def _describe_raw(bootstrap: str, client_id: str) -> float | None:
    d = DescribeClientQuotasRequest
    request = d[0](components=[d.ComponentData(entity_type="client-id", match_type=0, match=client_id)],
                   strict=False)
    response = DescribeClientQuotasResponse[0].decode(_raw(bootstrap, 48, request))
    assert response.error_code == 0, response.error_message
    for entry in response.entries or []:
        for value in entry.values:
            if value.key == "producer_byte_rate":
                return float(value.value)
    return None


def test_a_stopped_cluster_keeps_the_quotas_and_refuses_changes(lone_cluster: LocalKafka,
                                                                tmp_path: Path) -> None:
    """The whole cluster stopped (SIGSTOP) for 10 s: the members keep the quotas, a change is refused
    with an error naming the topic, and after SIGCONT a change is accepted and reaches both."""
    cluster = lone_cluster
    with ExitStack() as stack:
        fleet = KafkaFleet(stack, cluster.bootstrap, tmp_path, 2)
        a, b = fleet.start()
        assert _alter_raw(a.bootstrap, "outage", 1000.0) == (0, None)
        wait_until(lambda: produce_rate_of(b, "outage") == 1000.0, 5, "the quota on B")
        pids = [cluster.pid(node) for node in cluster.node_ids]
        stopped = time.monotonic()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            # the members notice within LIVENESS_CHECK_S + LIVENESS_TIMEOUT_MS (3 s); a change sent
            # before that waits ALTER_TIMEOUT_S for the acknowledgement, then is refused the same way
            time.sleep(3.5)
            asked = time.monotonic()
            code, message = _alter_raw(a.bootstrap, "outage", 2000.0)
            refused = (asked - stopped, time.monotonic() - asked, code, message)
            time.sleep(max(0.0, stopped + 10 - time.monotonic()))
            kept = [_describe_raw(m.bootstrap, "outage") for m in (a, b)]
            assert kept == [1000.0, 1000.0], kept
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        resumed = time.monotonic()
        accepted = None
        while time.monotonic() - resumed < 60:
            if _alter_raw(a.bootstrap, "outage", 3000.0) == (0, None):
                accepted = time.monotonic() - resumed
                break
            time.sleep(0.5)
        assert accepted is not None, a.log()[-3000:]
        reached = seconds_until(lambda: produce_rate_of(b, "outage") == 3000.0, 10)
        report(f"quota topic, cluster stopped 10 s: a change {refused[0]:.1f} s in refused after "
               f"{refused[1]:.2f} s ({refused[3]}); accepted {accepted:.1f} s after the cluster resumed, "
               f"shown through B {reached} s later")
        code, message = refused[2], refused[3] or ""
        assert code != 0 and fleet.topic in message and "unreachable" in message, refused
        assert reached is not None and reached <= 1.0


@pytest.mark.quiet
def test_a_member_killed_leaves_and_the_quota_holds_over_the_rest(kafka_cluster: LocalKafka,
                                                                 tmp_path: Path) -> None:
    """kill -9 of one of three: the others see it leave within the session timeout (plus the
    rebalance), a fleet-wide quota holds for a client spread over the two left, and a new member
    joins within one rebalance."""
    from proxy.fleet.kafka_group import HEARTBEAT_INTERVAL_MS, SESSION_TIMEOUT_MS

    client = "topic-spread"
    # the group's member list (where a member sends), not who was heard from lately
    peers_metric = "kthrottle_fleet_peer_addresses"
    with ExitStack() as stack:
        fleet = KafkaFleet(stack, kafka_cluster.bootstrap, tmp_path, 4)
        fleet.ports, spare_port = fleet.ports[:3], fleet.ports[3]
        a, b, c = fleet.start()
        for member in (a, b, c):
            wait_until(lambda m=member: m.metric(peers_metric) == 2, 15, "3 members")
        spread = [({"client-id": client}, [("producer_byte_rate", float(QUOTA), False)])]
        assert alter(a.bootstrap, spread) == [(0, None)]
        c.kill()
        killed = time.monotonic()
        # Heard from (the usage exchange, 3 full syncs) and listed (the group, after the coordinator
        # drops the member at the session timeout and the others rejoin)
        wait_until(lambda: all(m.metric("kthrottle_fleet_members") == 2 for m in (a, b)), 30, "2 heard from")
        heard = time.monotonic() - killed
        wait_until(lambda: all(m.metric(peers_metric) == 1 for m in (a, b)), 30, "2 listed")
        listed = time.monotonic() - killed

        topic = _topic(a.bootstrap, "topic-spread")
        started = time.monotonic()
        producers = [GreedyProducer(m.bootstrap, topic, started, client_id=client) for m in (a, b)]
        for producer in producers:
            stack.callback(producer.stop, True)
        time.sleep(RUN_S)
        for producer in producers:
            producer.stop()
        rate = sum(p.result.rate(RUN_S - 20, RUN_S) for p in producers)

        fleet.ports, fleet.dirs = [spare_port], fleet.dirs[3:]
        starting = time.monotonic()
        (d,) = fleet.start()
        wait_until(lambda: all(m.metric(peers_metric) == 2 for m in (a, b, d)), 30, "the new member listed")
        joined = time.monotonic() - starting
        report(f"group membership: kill -9 of 1 of 3 members: no longer heard from by the others after "
               f"{heard:.1f} s, out of their lists after {listed:.1f} s (session timeout "
               f"{SESSION_TIMEOUT_MS / 1000:.0f} s, heartbeat {HEARTBEAT_INTERVAL_MS / 1000:.0f} s); "
               f"a client over the 2 left: {rate:,.0f} B/s over the last 20 s ({rate / QUOTA:.3f}x "
               f"{QUOTA:,}); a new member started and in all 3 lists after {joined:.1f} s")
        assert heard <= SESSION_TIMEOUT_MS / 1000, heard
        # the coordinator drops it within the session timeout; the others rejoin on their next heartbeat
        assert listed <= (SESSION_TIMEOUT_MS + 2 * HEARTBEAT_INTERVAL_MS) / 1000, listed
        assert 0.9 * QUOTA <= rate <= 1.1 * QUOTA, f"{rate:,.0f} B/s against {QUOTA:,}"
        assert joined <= SESSION_TIMEOUT_MS / 1000, joined


def run_refused(upstream: str, tmp_path: Path, plane: str) -> subprocess.CompletedProcess[str]:
    """`kthrottle run` with the quota topic that is expected to refuse to start: its exit and output."""
    secret = tmp_path / "fleet.secret"
    secret.write_text(os.urandom(32).hex())
    config = tmp_path / "kthrottle.toml"
    config.write_text(f'[proxy]\nquota_store = "kafka"\n\n[fleet]\nlisten = "127.0.0.1:{free_udp_port()}"\n'
                      f'secret_file = "{secret}"\nname = "refused"\n\n[control_plane]\n{plane}\n')
    done = subprocess.run([sys.executable, "-m", "cli", "run", "--upstream", upstream,
                           "--listen", f"127.0.0.1:{free_port_block(11)}", "--config", str(config)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "bootstrap.servers=" not in done.stdout, done.stdout + done.stderr
    return done


def test_a_principal_the_cluster_refuses_stops_the_proxy_with_the_acls_it_needs(lone_cluster: LocalKafka,
                                                                                tmp_path: Path) -> None:
    """Against a cluster with Kafka's StandardAuthorizer, a proxy logging in as a user without ACLs
    exits at start with one line naming the topic and the ACLs, instead of serving without quotas."""
    assert lone_cluster.sasl_bootstrap is not None
    done = run_refused(lone_cluster.sasl_bootstrap, tmp_path,
                       'quota_topic = "__kthrottle_quotas_acl"\nsasl_mechanism = "PLAIN"\n'
                       f'sasl_username = "alice"\nsasl_password = "{SASL_USERS["alice"]}"')
    errors = [line for line in done.stderr.splitlines() if "__kthrottle_quotas_acl" in line]
    report(f"quota topic, a principal without ACLs: exit {done.returncode}: {errors[-1] if errors else '?'}")
    assert errors and "Authorization" in errors[-1] and "Topic READ, WRITE" in errors[-1], done.stderr[-3000:]


def test_a_topic_that_is_not_compacted_is_refused(kafka_cluster: LocalKafka, tmp_path: Path) -> None:
    """A quota topic made beforehand with cleanup.policy=delete would lose quotas to retention: the
    proxy refuses to start on it, naming the topic and the setting."""
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic

    topic = f"__kthrottle_quotas-delete-{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=kafka_cluster.bootstrap.split(","))
    try:
        admin.create_topics([NewTopic(topic, 1, 1, topic_configs={"cleanup.policy": "delete"})])
    finally:
        admin.close()
    done = run_refused(kafka_cluster.bootstrap, tmp_path, f'quota_topic = "{topic}"')
    assert topic in done.stderr and "cleanup.policy is 'delete'" in done.stderr, done.stderr[-3000:]
