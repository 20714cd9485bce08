"""Usage events (issue 14): a real `kthrottle run` with `[usage]` writes them to the cluster it fronts.

Known traffic from three tenants (client ids), one over its quota; the events read back straight
from the cluster sum exactly to what the proxy charged (its own Prometheus counters), their
intervals follow each other without gaps, and a cluster the writer cannot reach drops events
(counted) while the clients' traffic goes on.
"""

from __future__ import annotations

import itertools
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from harness.local_kafka import SASL_USERS, LocalKafka

from .clients import topic_name, wait_until
from .proxies import QuotaProxy
from .quota_runs import report
from .tcp_relay import TcpRelay

SLOW_QUOTA = 20_000  # bytes per second for the tenant over its quota
RECORD = b"x" * 1000


def _create(bootstrap: str, topic: str) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, 3, 1)])[topic].result(30)
    wait_until(lambda: len(admin.list_topics(topic, timeout=10).topics[topic].partitions) == 3, 30,
               f"{topic} in metadata")


def _produce(bootstrap: str, client_id: str, topic: str, count: int, **config: object) -> float:
    """`count` records with acks=all through the proxy, every one delivered; seconds it took."""
    producer = Producer({"bootstrap.servers": bootstrap, "client.id": client_id, "acks": "all",
                         "linger.ms": 5, "batch.size": 4000, **config})
    failures: list[str] = []

    def delivered(err: object, _msg: object) -> None:
        if err is not None:
            failures.append(str(err))

    started = time.monotonic()
    for i in range(count):
        producer.produce(topic, value=RECORD, key=str(i).encode(), on_delivery=delivered)
        producer.poll(0)
    assert producer.flush(120) == 0, f"{client_id}: records still unsent after 120 s"
    assert failures == [], failures
    return time.monotonic() - started


def _read_events(bootstrap: str, topic: str) -> list[tuple[bytes, dict[str, Any]]]:
    """Every record of the usage topic, read straight from the cluster up to its end offsets."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"usage-{topic}",
                         "enable.auto.commit": False})
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        ends = {p: consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                for p in partitions}
        consumer.assign([TopicPartition(topic, p, 0) for p in partitions])
        events: list[tuple[bytes, dict[str, Any]]] = []
        seen = dict.fromkeys(partitions, 0)
        deadline = time.monotonic() + 60
        while any(seen[p] < ends[p] for p in partitions):
            assert time.monotonic() < deadline, f"usage topic not read to its end: {seen} of {ends}"
            message = consumer.poll(1.0)
            if message is None or message.error() is not None:
                continue
            seen[message.partition()] = message.offset() + 1
            events.append((message.key(), json.loads(message.value())))
        return events
    finally:
        consumer.close()


def _counter(samples: dict[Any, float], name: str, **labels: str) -> float:
    """The enforced throttles' series (the counters' `mode` label), or any other exact series."""
    if name.startswith("kthrottle_throttle"):
        labels = {**labels, "mode": "enforced"}
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def _usage_config(topic: str, extra: str = "") -> str:
    # The [proxy] settings, then the [usage] table helper F's report test uses too, then the quota.
    return (f"quota_window_num = 3\n\n[usage]\ninterval_ms = 1000\ntopic = \"{topic}\"\n{extra}\n"
            f"[[quota]]\nclient_id = \"slow\"\nproducer_byte_rate = {SLOW_QUOTA}\n")


def test_events_sum_exactly_to_what_the_proxy_charged(kafka_cluster: LocalKafka, tmp_path: Path) -> None:
    usage_topic = topic_name("usage")
    data_topic = topic_name("usage-data")
    _create(kafka_cluster.bootstrap, data_topic)
    proxy = QuotaProxy(kafka_cluster.bootstrap, tmp_path, _usage_config(usage_topic))
    try:
        proxy.wait_for_log("usage events every 1000 ms")
        before = proxy.metrics()
        charged: dict[str, tuple[float, float]] = {}
        took: dict[str, float] = {}
        for client_id, count in (("fast", 300), ("slow", 150)):
            start = proxy.metrics()
            took[client_id] = _produce(proxy.bootstrap, client_id, data_topic, count)
            end = proxy.metrics()
            charged[client_id] = tuple(  # type: ignore[assignment]
                _counter(end, name, api="Produce") - _counter(start, name, api="Produce")
                for name in ("kthrottle_request_bytes_total", "kthrottle_requests_total"))
        # a third tenant that only asks for metadata
        AdminClient({"bootstrap.servers": proxy.bootstrap, "client.id": "meta"}).list_topics(timeout=10)
        after = proxy.metrics()
        slow_labels = {"quota": "producer_byte_rate", "user": "", "client_id": "slow"}
        throttles = _counter(after, "kthrottle_throttles_total", **slow_labels)
        throttle_s = _counter(after, "kthrottle_throttle_time_seconds_total", **slow_labels)
        total_bytes = (_counter(after, "kthrottle_request_bytes_total", api="Produce")
                       - _counter(before, "kthrottle_request_bytes_total", api="Produce"))
        assert throttles > 0, "the slow tenant was never throttled: the test would prove nothing"
        wait_until(lambda: _counter(proxy.metrics(), "kthrottle_usage_events_sent_total") > 0, 30,
                   "a first usage event acknowledged")
    finally:
        proxy.stop()  # SIGINT: the current interval is written before the proxy exits
    assert proxy.process.returncode == 0, proxy.log()[-3000:]
    assert "usage events: created topic" in proxy.log()

    events = _read_events(kafka_cluster.bootstrap, usage_topic)
    by_client: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for key, event in events:
        assert event["schema"] == 1
        assert json.loads(key) == [event["user"], event["client_id"]]
        by_client[event["client_id"]].append(event)
    for client_id in ("fast", "slow"):
        mine = by_client[client_id]
        assert {e["user"] for e in mine} == {"ANONYMOUS"}
        produce_bytes = sum(e["produce_bytes"] for e in mine)
        produce_requests = sum(e["requests"].get("Produce", 0) for e in mine)
        assert (produce_bytes, produce_requests) == charged[client_id], client_id
        report(f"usage events: {client_id}: {produce_bytes} produce bytes in {produce_requests} requests "
               f"over {len(mine)} intervals, as the proxy's counters ({took[client_id]:.1f} s of traffic)")
    assert sum(e["produce_bytes"] for _, e in events) == total_bytes
    slow = by_client["slow"]
    counted = sum(e["throttles"].get("producer_byte_rate", {}).get("count", 0) for e in slow)
    throttle_ms = sum(e["throttles"].get("producer_byte_rate", {}).get("time_ms", 0) for e in slow)
    assert counted == throttles
    assert throttle_ms == round(throttle_s * 1000)
    assert all(e["quotas"] == {"producer_byte_rate": float(SLOW_QUOTA)} for e in slow)
    assert all(e["quotas"] == {} and e["throttles"] == {} for e in by_client["fast"])
    assert sum(e["requests"].get("Metadata", 0) for e in by_client["meta"]) >= 1
    # one writer, so one proxy identity; its intervals follow each other without a gap or overlap
    assert len({json.dumps(e["proxy"], sort_keys=True) for _, e in events}) == 1
    intervals = {e["interval"]["seq"]: (e["interval"]["start_ms"], e["interval"]["end_ms"])
                 for _, e in events}
    for seq, (start, end) in intervals.items():
        assert start < end
        if seq + 1 in intervals:
            assert intervals[seq + 1][0] == end, (seq, intervals)
    spans = sorted(intervals.values())
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    # and no entity has two events for one interval (nothing written twice)
    keys = [(e["user"], e["client_id"], e["interval"]["seq"]) for _, e in events]
    assert len(keys) == len(set(keys))


def test_an_unreachable_cluster_drops_events_and_traffic_goes_on(kafka_cluster: LocalKafka,
                                                                 tmp_path: Path) -> None:
    relay = TcpRelay(("127.0.0.1", int(kafka_cluster.bootstrap.rsplit(":", 1)[1])))
    relay.cut()  # the writer's path to the cluster: every connection closed at once
    host, port = relay.address
    data_topic = topic_name("usage-away")
    _create(kafka_cluster.bootstrap, data_topic)
    extra = f"bootstrap_servers = [\"{host}:{port}\"]\nmax_pending_intervals = 2\n"
    proxy = QuotaProxy(kafka_cluster.bootstrap, tmp_path, _usage_config(topic_name("usage-away"), extra))
    try:
        proxy.wait_for_log("usage events every 1000 ms")
        rounds = 0
        took = slowest = 0.0
        deadline = time.monotonic() + 90  # a bound on the loop, not on the proxy's speed
        while (_counter(proxy.metrics(), "kthrottle_usage_events_dropped_total", reason="pending_full") < 3
               or "cannot reach the cluster" not in proxy.log()):
            assert time.monotonic() < deadline, (
                f"no usage event dropped, or no failure logged, while the writer could not reach the "
                f"cluster:\n{proxy.log()[-3000:]}")
            spent = _produce(proxy.bootstrap, "fast", data_topic, 50)  # every record delivered
            took += spent
            slowest = max(slowest, spent)
            rounds += 1
        samples = proxy.metrics()
        assert _counter(samples, "kthrottle_usage_events_sent_total") == 0
        assert _counter(samples, "kthrottle_usage_pending_events") <= 2  # max_pending_intervals x 1 entity
        report(f"usage events: cluster unreachable for the writer: {rounds * 50} records produced in "
               f"{took:.1f} s through the proxy meanwhile (slowest 50 in {slowest:.2f} s), "
               f"{_counter(samples, 'kthrottle_usage_events_dropped_total', reason='pending_full'):.0f} "
               "events dropped")
    finally:
        proxy.stop()
        relay.close()
    assert proxy.process.returncode == 0, proxy.log()[-3000:]


def test_sasl_users_over_a_tls_cluster(kafka_cluster: LocalKafka, tmp_path: Path) -> None:
    """In front of the SASL_SSL listener: the writer logs in with [usage]'s SCRAM credentials over
    [upstream_tls]; the clients' SASL users are the events' users, with exact sums per user."""
    assert kafka_cluster.sasl_ssl_bootstrap and kafka_cluster.certificates is not None
    usage_topic = topic_name("usage-sasl")
    data_topic = topic_name("usage-sasl-data")
    _create(kafka_cluster.bootstrap, data_topic)
    settings = (f"\n[upstream_tls]\nca = \"{kafka_cluster.certificates.ca}\"\n\n"
                f"[usage]\ninterval_ms = 1000\ntopic = \"{usage_topic}\"\n"
                "sasl_mechanism = \"SCRAM-SHA-512\"\n"
                f"sasl_username = \"admin\"\nsasl_password = \"{SASL_USERS['admin']}\"\n\n"
                f"[[quota]]\nuser = \"bob\"\nproducer_byte_rate = {SLOW_QUOTA}\n")
    proxy = QuotaProxy(kafka_cluster.sasl_ssl_bootstrap, tmp_path, "quota_window_num = 3\n" + settings)
    charged: dict[str, float] = {}
    try:
        proxy.wait_for_log("usage events: writing to topic", timeout=60)
        for user, count in (("alice", 120), ("bob", 100)):
            start = proxy.metrics()
            _produce(proxy.bootstrap, f"{user}-app", data_topic, count, **{
                "security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "PLAIN", "sasl.username": user,
                "sasl.password": SASL_USERS[user]})
            end = proxy.metrics()
            charged[user] = (_counter(end, "kthrottle_request_bytes_total", api="Produce")
                             - _counter(start, "kthrottle_request_bytes_total", api="Produce"))
        bob_throttles = _counter(proxy.metrics(), "kthrottle_throttles_total", quota="producer_byte_rate",
                                 user="bob", client_id="")
        assert bob_throttles > 0, "bob was never throttled: the test would prove nothing"
    finally:
        proxy.stop()
    assert proxy.process.returncode == 0, proxy.log()[-3000:]
    events = [event for _, event in _read_events(kafka_cluster.bootstrap, usage_topic)]
    for user in ("alice", "bob"):
        mine = [e for e in events if e["user"] == user]
        assert {e["client_id"] for e in mine} == {f"{user}-app"}
        assert sum(e["produce_bytes"] for e in mine) == charged[user], user
    bob = [e for e in events if e["user"] == "bob"]
    assert sum(e["throttles"].get("producer_byte_rate", {}).get("count", 0) for e in bob) == bob_throttles
    assert all(e["quotas"] == {"producer_byte_rate": float(SLOW_QUOTA)} for e in bob)
