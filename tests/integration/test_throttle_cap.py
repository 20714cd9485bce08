"""`[proxy] max_throttle_time_ms` (issue 28): no throttle goes above it, against a real cluster.

Two proxies side by side in front of one cluster, each with the same producer_byte_rate quota; one
caps throttles at CAP_MS. A raw client sends Produce v9 requests of RECORD_BYTES one after another
and reads each answer's throttle_time_ms. Uncapped, Kafka's arithmetic throttles the second one for
seconds; capped, every throttle is at most CAP_MS, the usage still counts (each later request is
throttled again), and the KIP-219 mute that follows a throttle ends with the cap: the next answer
comes within CAP_MS plus the broker's own time.
"""

from __future__ import annotations

import itertools
import socket
import time
from pathlib import Path

from confluent_kafka.admin import AdminClient
from kafka.protocol.producer import ProduceResponse

from harness.local_kafka import LocalKafka
from protocol.frames import frame
from protocol.headers import encode_request_header
from tests.integration.clients import produce_body
from tests.integration.fuzz import _read_frame
from tests.integration.proxies import QuotaProxy
from tests.integration.quota_runs import report
from tests.integration.test_quotas import _topic

CAP_MS = 200
QUOTA = 50_000
RECORD_BYTES = 400_000
CLIENT = "capped-producer"
#: what the broker itself may take for a 400 KB acks=1 Produce on a busy machine, beyond the mute
BROKER_SLACK_S = 1.0


def _produce(proxy: QuotaProxy, topic: str, count: int) -> list[tuple[int, float]]:
    """`count` Produce requests one after another to partition 0's leader through `proxy`: each
    answer's throttle_time_ms and how long it took to come (s)."""
    leader = AdminClient({"bootstrap.servers": proxy.bootstrap}).list_topics(topic, timeout=15) \
        .topics[topic].partitions[0].leader
    body = produce_body(topic, b"v" * RECORD_BYTES, timeout_ms=10_000)
    answers: list[tuple[int, float]] = []
    with socket.create_connection(("127.0.0.1", proxy.node_port(leader)), timeout=30) as sock:
        for correlation_id in range(count):
            sent = time.monotonic()
            sock.sendall(frame(encode_request_header(0, 9, correlation_id, CLIENT) + body))
            answer = ProduceResponse.decode(_read_frame(sock)[5:], version=9)
            errors = [p.error_code for t in answer.responses for p in t.partition_responses]
            assert errors == [0], errors
            answers.append((answer.throttle_time_ms, time.monotonic() - sent))
    return answers


def test_no_throttle_goes_above_max_throttle_time_ms(kafka_cluster: LocalKafka, tmp_path: Path) -> None:
    quota = f'[[quota]]\nclient_id = "{CLIENT}"\nproducer_byte_rate = {QUOTA}\n'
    topic = _topic(kafka_cluster.bootstrap, "capped")
    (tmp_path / "capped").mkdir()
    (tmp_path / "uncapped").mkdir()
    cap = f"max_throttle_time_ms = {CAP_MS}"
    with QuotaProxy(kafka_cluster.bootstrap, tmp_path / "capped", cap) as capped, \
            QuotaProxy(kafka_cluster.bootstrap, tmp_path / "uncapped") as uncapped:
        capped.set_quotas(quota)
        uncapped.set_quotas(quota)
        # uncapped: two requests only (the second's answer comes at once, its mute after it)
        plain = _produce(uncapped, topic, 2)
        held = _produce(capped, topic, 10)
        throttle_total = capped.metric("kthrottle_throttle_time_seconds_total", quota="producer_byte_rate",
                                       user="", client_id=CLIENT)
        log = capped.log()
    report(f"max_throttle_time_ms = {CAP_MS}: throttles uncapped {[t for t, _ in plain]} ms; capped "
           f"{[t for t, _ in held]} ms, answers after {[round(s * 1000) for _, s in held]} ms")
    assert max(t for t, _ in plain) > 5 * CAP_MS, "uncapped, the quota did not throttle above the cap"
    assert all(t <= CAP_MS for t, _ in held), held
    assert sum(1 for t, _ in held if t == CAP_MS) >= 8, "capped: the usage stopped counting"
    # a throttled answer mutes the connection: the next answer waits out at most the cap
    after_throttle = [s for (t, _), (_, s) in itertools.pairwise(held) if t > 0]
    assert after_throttle and max(after_throttle) <= CAP_MS / 1000 + BROKER_SLACK_S, held
    assert 0 < throttle_total <= len(held) * CAP_MS / 1000
    assert "Traceback" not in log, log[-3000:]
