"""One quota across a fleet of proxies (issue 11), against the real cluster, with real processes.

Every proxy here is a real `kthrottle run` process with a `[fleet]` table; the clients are real
librdkafka producers and consumers, each bootstrapped to a different proxy, at full speed. Faults
come from outside: kill -9 of a member, a lossy UDP relay between the members
(tests/integration/udp_relay.py), forged and replayed datagrams sent at a member's UDP port.

The proxies use `quota_window_num = 3` (3 samples of 1 s), like the other rate-accuracy runs
(test_quota_accuracy.py says why: with 11 samples a greedy client's sawtooth has a period of ~11 s
and a 20 s measurement swings by +-15 % around the right average). That also makes the fleet's
ageing short: a silent member's usage counts fully for 3 s (3 full syncs) and fades out over one
quota window (3 s) after that. The quota (1 MB/s over the fleet) is small enough that neither the
clients nor the proxies are short of CPU on a 2-core machine: what is measured is the algorithm.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import re
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from prometheus_client.parser import text_string_to_metric_families

from harness.local_kafka import LocalKafka
from harness.ports import free_udp_port
from quotas.fleet import UsageEntry, encode_usage
from quotas.types import QuotaType

from .clients import wait_until
from .conftest import QUOTA_SETTINGS
from .proxies import RunningProxy, free_port_block
from .quota_runs import RunResult, report, slope
from .tcp_relay import TcpRelay
from .test_controller_mutations import THROTTLING_QUOTA_EXCEEDED, _create, _delete_directly, _partitions
from .test_quotas import _end_offsets, _fill, _topic
from .udp_relay import UdpRelay
from .zookeeper import kazoo_client, running_zookeeper

QUOTA = 1_000_000  # bytes per second over the whole fleet

#: Three or four proxies and their greedy clients must offer more than the fleet's quotas (rates, a
#: CreateTopics loop against the mutation quota): CPU-starved beside other workers they fell short.
pytestmark = pytest.mark.cpu_sensitive
RUN_S = 30.0
FLEET = "fleet-test"
PRODUCER = "fleet-producer"
CONSUMER = "fleet-consumer"
#: a client creating topics under one controller mutation quota over the fleet (burst 11 x 2)
MUTATOR = "fleet-mutator"
MUTATION_RATE = 2.0
MUTATION_S = 16.0
VALUE_BYTES = 10_000
PRODUCE_LABELS = {"quota": "producer_byte_rate", "user": "", "client_id": PRODUCER}
FETCH_LABELS = {"quota": "consumer_byte_rate", "user": "", "client_id": CONSUMER}
FLEET_PRODUCE_RATE = "kthrottle_fleet_produce_byte_rate_bytes_per_second"
LOCAL_PRODUCE_RATE = "kthrottle_produce_byte_rate_bytes_per_second"
#: How long a dead member's usage still counts: 3 full syncs at full weight, then one quota window
#: (3 samples of 1 s) fading to nothing.
DEAD_MEMBER_FADES_S = 3.0 + 3.0


# -- members ------------------------------------------------------------------------------------------


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics on `port`, keyed by (name, sorted labels)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    samples = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def summed(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    """One series of a scrape, or the sum of those whose labels include `labels` (the throttle
    counters' `mode`: enforced and shadow); 0 when there is none."""
    want = set(labels.items())
    return sum(value for (got, series), value in samples.items() if got == name and want <= set(series))


class Member(RunningProxy):
    """`kthrottle run` with a `[fleet]` table (or `--workers N`), a quota file and metrics."""

    def __init__(self, upstream: str, workdir: Path, quotas: str, *, udp_port: int | None = None,
                 peers: list[str] | None = None, fleet: str = "", workers: int = 1,
                 name: str | None = FLEET, upstream_tls: str = "", settings: str = "") -> None:
        """`settings`: more `[proxy]` lines; `fleet`: the `[fleet]` lines after listen and secret."""
        self.workers = workers
        self.metrics_port = free_port_block(workers)
        self.udp_port = udp_port
        config = self.config_path = workdir / f"member-{uuid.uuid4().hex[:8]}.toml"
        text = f"[proxy]\n{QUOTA_SETTINGS}\n{settings}\n\n"
        if udp_port is not None:
            secret = workdir / "fleet.secret"
            if not secret.exists():
                secret.write_text(os.urandom(32).hex() + "\n")
            self.secret = secret.read_bytes().strip()
            peer_list = ", ".join(f'"{peer}"' for peer in peers or [])
            named = f'name = "{name}"\n' if name is not None else ""
            text += (f'[fleet]\n{named}listen = "127.0.0.1:{udp_port}"\n'
                     f'secret_file = "{secret}"\n{fleet or f"peers = [{peer_list}]"}\n\n')
        config.write_text(text + upstream_tls + quotas + "\n")
        args = ["--config", str(config), "--metrics-port", str(self.metrics_port)]
        if workers > 1:
            args += ["--workers", str(workers)]
        super().__init__(upstream, extra_args=args)
        if workers > 1:
            wait_until(lambda: self.log().count("bootstrap.servers=") >= workers, 30, "every worker ready")

    def metrics(self, worker: int = 0) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return scrape(self.metrics_port + worker)

    def metric(self, name: str, worker: int = 0, **labels: str) -> float:
        """`summed` over a scrape of `worker`'s metrics."""
        return summed(self.metrics(worker), name, **labels)

    def metric_when_up(self, name: str, worker: int = 0, **labels: str) -> float | None:
        """`metric`, or None while the metrics port does not answer (a worker restarting)."""
        try:
            return self.metric(name, worker, **labels)
        except (OSError, urllib.error.URLError):
            return None

    def rejected(self) -> dict[str, float]:
        samples = self.metrics()
        return {dict(labels)["reason"]: value for (name, labels), value in samples.items()
                if name == "kthrottle_fleet_datagrams_rejected_total"}

    def kill(self) -> None:
        """kill -9 (the whole process group: a supervisor and its workers)."""
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


def quota_text(**values: int) -> str:
    lines = []
    for key, value in values.items():
        client = PRODUCER if key == "producer_byte_rate" else CONSUMER
        lines.append(f'[[quota]]\nclient_id = "{client}"\n{key} = {value}\n')
    return "\n".join(lines)


def static_fleet(stack: ExitStack, cluster: LocalKafka, workdir: Path, quotas: str, count: int = 3,
                 relay: tuple[float, float] | None = None, spare: int = 0) -> tuple[list[Member], list[int],
                                                                                     UdpRelay | None]:
    """`count` members with static peers (plus `spare` addresses listed for members started later),
    each listing the others directly, or their front ports on a relay dropping and reordering."""
    ports = [free_udp_port() for _ in range(count + spare)]
    relayed = None
    if relay is not None:
        relayed = stack.enter_context(UdpRelay([("127.0.0.1", p) for p in ports], *relay))
        addresses = [relayed.front(i) for i in range(len(ports))]
    else:
        addresses = [("127.0.0.1", p) for p in ports]
    (workdir / "fleet.secret").write_text(os.urandom(32).hex() + "\n")

    def start(index: int) -> Member:
        peers = [f"{h}:{p}" for i, (h, p) in enumerate(addresses) if i != index]
        return Member(cluster.bootstrap, workdir, quotas, udp_port=ports[index], peers=peers)

    with ThreadPoolExecutor(count) as pool:
        members = list(pool.map(start, range(count)))
    for member in members:
        stack.callback(member.stop)
    return members, ports, relayed


# -- clients ------------------------------------------------------------------------------------------


class GreedyProducer:
    """A librdkafka producer at full speed on its own thread until stopped; deliveries are timed.

    Not idempotent, as the fleet's figures were taken with (at-least-once, acks=1). `retries` counts
    what may have made librdkafka send records again: requests it retried (its statistics'
    `txretries`), and requests that timed out or connections that dropped with requests in flight
    (its error events; its message-level resends are in no statistic). A byte-rate throttle has no
    upper bound, in Kafka as here, so a request pipelined behind a long mute can outlast
    request.timeout.ms and be sent again on a new connection while the proxy, as a broker does,
    still delivers what the old one sent. Only then may a record land twice (`assert_each_record_once`).
    """

    def __init__(self, bootstrap: str, topic: str, started: float, client_id: str = PRODUCER) -> None:
        self.result = RunResult(started)
        self.topic = topic
        self._retried = 0
        #: librdkafka's error events that may have made it resend (timeouts, dropped connections)
        self.resend_events: list[str] = []
        self._producer = Producer({"bootstrap.servers": bootstrap, "client.id": client_id, "linger.ms": 5,
                                   "acks": 1, "queue.buffering.max.kbytes": 4096,
                                   "statistics.interval.ms": 500, "stats_cb": self._stats,
                                   "error_cb": self._error})
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _delivered(self, err: KafkaError | None, _msg: object) -> None:
        with self._lock:
            if err is not None:
                self.result.errors.append(str(err))
            else:
                self.result.events.append((time.monotonic(), VALUE_BYTES))
                self.result.records += 1

    def _stats(self, document: str) -> None:
        brokers = json.loads(document).get("brokers", {})
        self._retried = sum(broker.get("txretries", 0) for broker in brokers.values())

    def _error(self, error: KafkaError) -> None:
        if error.code() in (KafkaError._TIMED_OUT, KafkaError._TRANSPORT, KafkaError._MSG_TIMED_OUT):
            self.resend_events.append(error.str())

    @property
    def retries(self) -> int:
        return self._retried + len(self.resend_events)

    def _run(self) -> None:
        value = b"x" * VALUE_BYTES
        sent = 0
        while not self._stop.is_set():
            try:
                self._producer.produce(self.topic, value, str(sent % 97).encode(),
                                       on_delivery=self._delivered)
                sent += 1
            except BufferError:
                self._producer.poll(0.05)
                continue
            self._producer.poll(0)
        self.sent = sent

    def stop(self, abandon: bool = False) -> None:
        """Stop producing and wait for what is in flight (`abandon`: its proxy is dead, drop it)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(30)
        if abandon:
            self._producer.purge()
            self._producer.flush(5)
            return
        left = self._producer.flush(120)
        assert left == 0 and self.result.records == self.sent, (
            f"{self.sent} sent, {self.result.records} acknowledged: {self.result.errors[:3]}")
        self._producer.poll(0.6)  # one more statistics report: retries up to the last delivery


def assert_each_record_once(bootstrap: str, topic: str, producers: list[GreedyProducer]) -> None:
    """The topic holds every acknowledged record once: none lost, and none twice unless its client sent
    a request again (GreedyProducer: at-least-once), which the proxy cannot tell from a new one."""
    stored = _end_offsets(bootstrap, topic)
    acknowledged = sum(p.result.records for p in producers)
    retries = sum(p.retries for p in producers)
    assert stored >= acknowledged, f"{acknowledged - stored} acknowledged records lost"
    if retries == 0:
        assert stored == acknowledged, f"{stored - acknowledged} records stored twice, none sent twice"
    elif stored > acknowledged:
        events = [event for p in producers for event in p.resend_events][:3]
        report(f"{stored - acknowledged} records stored twice: librdkafka retried or lost connections "
               f"{retries} times ({events})")


def combined(started: float, producers: list[GreedyProducer]) -> RunResult:
    """All producers' deliveries as one run."""
    together = RunResult(started)
    together.events = sorted(event for producer in producers for event in producer.result.events)
    return together


def acked_timeline(started: float, producers: list[GreedyProducer], start_s: float, end_s: float) -> str:
    """Each producer's acknowledged kB per second from `start_s` to `end_s`: a failure's shape (which
    member let the bytes through, and whether in a few bursts or throughout)."""
    rows = []
    for second in range(int(start_s), int(end_s) + 1):
        lo, hi = started + second, started + second + 1
        kbs = [sum(size for at, size in p.result.events if lo <= at < hi) // 1000 for p in producers]
        rows.append(f"{second}s:" + "/".join(str(kb) for kb in kbs))
    return " ".join(rows)


class RateSampler:
    """Every second, each member's fleet rate and local rate of one entity, from its metrics."""

    def __init__(self, members: list[tuple[Member, int]], started: float, fleet_name: str, local_name: str,
                 labels: dict[str, str]) -> None:
        self.samples: list[tuple[float, int, float, float]] = []  # (time, member, fleet, local)
        self._members = members
        self._started = started
        self._names = (fleet_name, local_name)
        self._labels = tuple(sorted(labels.items()))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            for index, (member, worker) in enumerate(self._members):
                try:
                    samples = member.metrics(worker)
                except (OSError, urllib.error.URLError):
                    continue  # killed
                fleet = samples.get((self._names[0], self._labels))
                local = samples.get((self._names[1], self._labels))
                if fleet is not None and local is not None:
                    self.samples.append((time.monotonic() - self._started, index, fleet, local))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(15)

    def mean(self, index: int, start_s: float, end_s: float) -> tuple[float, float]:
        """Mean fleet and local rate member `index` showed between `start_s` and `end_s`."""
        picked = [(f, loc) for t, i, f, loc in self.samples if i == index and start_s <= t <= end_s]
        assert len(picked) >= (end_s - start_s) / 2, f"member {index}: {len(picked)} metric samples"
        return sum(f for f, _ in picked) / len(picked), sum(loc for _, loc in picked) / len(picked)


def assert_fleet_rate_shown(sampler: RateSampler, count: int, measured: float, what: str) -> None:
    """Each member's metrics show the fleet's rate: the sum of every member's own rate, ~ the rate
    the clients got together.

    These are Kafka's windowed rates of request bytes, read every second: a greedy client's sits at
    its bound or above it (it is throttled as soon as it passes it, by as much as its last request
    took it over, and waits until it is back), so their average is above what the clients got: by
    5 % to 33 % in these runs, depending on how large librdkafka's requests after a throttle were.
    """
    means = [sampler.mean(index, RUN_S - 20, RUN_S) for index in range(count)]
    together = sum(local for _, local in means)
    for index, (fleet, local) in enumerate(means):
        report(f"{what}: member {index} showed a fleet rate of {fleet:,.0f} B/s ({fleet / together:.3f}x the "
               f"members' own rates summed, {fleet / measured:.3f}x what the clients got), its own "
               f"{local:,.0f} B/s")
        assert 0.9 * together <= fleet <= 1.1 * together, f"member {index}: fleet rate {fleet:,.0f} B/s"
        assert local > 0, f"member {index} carried nothing"
    # Meaningful only where a member's own rate is well below the fleet's: such a member shows its
    # peers' rates too. The kernel may move connections between workers mid-run (h24: 6 % / 94 %
    # over the last 20 s after a 25 %+ split at 3 s), so one such member is required, not every one.
    assert min(local for _, local in means) < 0.8 * together, f"no member carried less than 80 %: {means}"
    assert 0.95 * measured <= together <= 1.4 * measured, f"members' own rates {means}"


# -- forged datagrams -----------------------------------------------------------------------------------


def inject(udp_port: int, genuine: list[bytes], secret: bytes) -> dict[str, int]:
    """Datagrams a member must refuse, sent at its UDP port; returns how many of each reason.

    Each one, if applied, would claim a rate of 1 GB/s for the producers' client id and so stop them:
    the rate run around it shows none was.
    """
    flood = [UsageEntry(QuotaType.PRODUCE, "", PRODUCER, 1e9)]
    now = int(time.time() * 1000)
    sender = int.from_bytes(os.urandom(8), "big")
    real = genuine[-1]
    datagrams: list[tuple[str, bytes]] = []
    for seq in range(5):  # signed with another secret
        datagrams += [("bad_mac", d) for d in encode_usage(FLEET, sender, seq + 1, now, True, flood, [],
                                                          os.urandom(32))]
    datagrams.append(("bad_mac", real[:-1] + bytes([real[-1] ^ 1])))  # one bit of a real MAC flipped
    datagrams.append(("bad_mac", real[:-10]))  # truncated, still long enough to hold a MAC
    datagrams.append(("malformed", real[:30]))  # truncated below the smallest datagram
    datagrams.append(("malformed", b""))
    datagrams.append(("malformed", bytes([9]) + real[1:]))  # unknown version
    # signed with the fleet's secret but lying about its length: 65,535 entries in a short datagram
    body = bytes([1, 0, len(FLEET)]) + FLEET.encode() + (sender + 1).to_bytes(8, "big") + \
        (1).to_bytes(8, "big") + now.to_bytes(8, "big") + bytes([0]) + b"\xff\xff"
    datagrams.append(("malformed", body + hmac.new(secret, body, hashlib.sha256).digest()))
    datagrams += [("stale", d) for d in encode_usage(FLEET, sender + 2, 1, now - 60_000, True, flood, [],
                                                     secret)]
    datagrams += [("other_fleet", d) for d in encode_usage("another-fleet", sender + 3, 1, now, True, flood,
                                                           [], secret)]
    datagrams += [("replayed", d) for d in genuine[-5:]]  # real datagrams the member already applied
    expected: dict[str, int] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for reason, datagram in datagrams:
            sock.sendto(datagram, ("127.0.0.1", udp_port))
            expected[reason] = expected.get(reason, 0) + 1
    return expected


# -- the tests ---------------------------------------------------------------------------------------------


def test_three_proxies_hold_three_producers_to_one_quota(kafka_cluster: LocalKafka, tmp_path: Path) -> None:
    """Three producers with one client id, each through its own proxy, share one quota; forged,
    truncated, replayed, stale and foreign datagrams sent at a member mid-run change nothing.

    The members exchange through a relay that passes everything (and keeps datagrams to replay)."""
    with ExitStack() as stack:
        members, ports, relay = static_fleet(stack, kafka_cluster, tmp_path,
                                             quota_text(producer_byte_rate=QUOTA), relay=(0.0, 0.0))
        assert relay is not None
        for member in members:
            wait_until(lambda m=member: m.metric("kthrottle_fleet_members") == 3, 10, "3 members")
        topic = _topic(members[0].bootstrap, "fleet-p")
        started = time.monotonic()
        sampler = RateSampler([(m, 0) for m in members], started, FLEET_PRODUCE_RATE, LOCAL_PRODUCE_RATE,
                              PRODUCE_LABELS)
        producers = [GreedyProducer(m.bootstrap, topic, started) for m in members]
        for producer in producers:
            stack.callback(producer.stop, True)  # a failed assertion must not leave them running
        time.sleep(15)
        before = members[0].rejected()
        expected = inject(ports[0], relay.recent(0), members[0].secret)
        deadline = time.monotonic() + 10
        while not all(members[0].rejected()[r] - before[r] >= n for r, n in expected.items()):
            assert time.monotonic() < deadline, (
                f"rejections {members[0].rejected()} (before {before}), expected {expected} more:\n"
                f"{members[0].log()[-3000:]}")
            time.sleep(0.2)
        time.sleep(max(0.0, started + RUN_S - time.monotonic()))
        for producer in producers:
            producer.stop()
        sampler.stop()
        after = members[0].rejected()
        rate = combined(started, producers).rate(RUN_S - 20, RUN_S)
        shares = [p.result.rate(RUN_S - 20, RUN_S) for p in producers]
        report(f"fleet of 3, 3 librdkafka producers: quota {QUOTA:,} B/s, combined {rate:,.0f} B/s over the "
               f"last 20 s ({rate / QUOTA:.3f}x; shares {', '.join(f'{s / QUOTA:.2f}' for s in shares)})")
        assert {reason: after[reason] - before[reason] for reason in after} == {
            reason: expected.get(reason, 0) for reason in after}, "rejections by reason"
        # 0.947-1.027x in 19 fresh runs, 1.053x in h19: the members' usage exchange lags a loaded
        # machine by a little; the upper bound is 1.07x, not 1.05x
        assert 0.9 * QUOTA <= rate <= 1.07 * QUOTA, f"{rate:,.0f} B/s against {QUOTA:,}"
        assert_fleet_rate_shown(sampler, 3, rate, "fleet of 3 producers")
        assert_each_record_once(members[0].bootstrap, topic, producers)
        for member in members:
            assert member.metric("kthrottle_throttles_total", **PRODUCE_LABELS) > 0
            assert member.metric("kthrottle_quota_limit", **PRODUCE_LABELS) == QUOTA
        assert all(m.alive() for m in members)


class CreateTopicsLoop:
    """Strict CreateTopics (v7) of one 1-partition topic at a time, each on the next member, for
    `seconds` on its own thread: which were accepted, and when."""

    def __init__(self, members: list[Member], client_id: str, seconds: float) -> None:
        self.prefix = f"fleet-cm-{uuid.uuid4().hex[:8]}"
        self.accepted: list[tuple[float, str]] = []
        self.refused: list[str] = []
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._run, args=(members, client_id, seconds), daemon=True)
        self._thread.start()

    def _run(self, members: list[Member], client_id: str, seconds: float) -> None:
        self.started = time.monotonic()
        i = 0
        while time.monotonic() < self.started + seconds:
            name = f"{self.prefix}-{i}"
            response, _ = _create(members[i % len(members)].bootstrap, 7, client_id, [name], 1)
            (topic,) = response.topics
            if topic.error_code == 0:
                self.accepted.append((time.monotonic() - self.started, name))
            elif topic.error_code == THROTTLING_QUOTA_EXCEEDED:
                self.refused.append(name)
            else:
                self.errors.append(f"{name}: {topic.error_code}")
            i += 1
            time.sleep(0.03)

    def join(self) -> None:
        self._thread.join(120)


def test_the_same_through_a_lossy_relay(kafka_cluster: LocalKafka, tmp_path: Path) -> None:
    """5 % of the datagrams between members dropped and 5 % reordered: 0.85-1.10x. Meanwhile a
    client creating topics round the three members is held to one controller mutation quota
    (KIP-599's token bucket: burst + rate x time, not three times that)."""
    quotas = (quota_text(producer_byte_rate=QUOTA)
              + f'\n[[quota]]\nclient_id = "{MUTATOR}"\ncontroller_mutation_rate = {MUTATION_RATE}\n')
    with ExitStack() as stack:
        members, _ports, relay = static_fleet(stack, kafka_cluster, tmp_path, quotas, relay=(0.05, 0.05))
        assert relay is not None
        topic = _topic(members[0].bootstrap, "fleet-lossy")
        started = time.monotonic()
        producers = [GreedyProducer(m.bootstrap, topic, started) for m in members]
        for producer in producers:
            stack.callback(producer.stop, True)  # a failed assertion must not leave them running
        time.sleep(2)
        creating = CreateTopicsLoop(members, MUTATOR, MUTATION_S)
        stack.callback(lambda: _delete_directly(kafka_cluster, [n for _, n in creating.accepted]))
        time.sleep(max(0.0, started + RUN_S - time.monotonic()))
        for producer in producers:
            producer.stop()
        creating.join()
        assert not creating.errors, creating.errors
        last_s = creating.accepted[-1][0]
        burst = 11 * MUTATION_RATE
        allowed = burst + MUTATION_RATE * last_s
        report(f"fleet of 3 through the lossy relay, strict CreateTopics round the members under "
               f"controller_mutation_rate {MUTATION_RATE}/s: {len(creating.accepted)} accepted by "
               f"{last_s:.1f} s (a bucket allows {allowed:.0f}: burst {burst:.0f} + rate x time; three "
               f"apart would allow three times that), {len(creating.refused)} refused")
        # a strict bucket accepts while not in debt; a report's latency may let a topic or two more in
        assert len(creating.accepted) <= allowed + 3, creating.accepted
        assert len(creating.accepted) >= burst + MUTATION_RATE * (MUTATION_S - 1) - 3, creating.accepted
        created = _partitions(kafka_cluster, creating.prefix)
        assert created == {name: 1 for _, name in creating.accepted}, "accepted = created, refused = not"
        rate = combined(started, producers).rate(RUN_S - 20, RUN_S)
        counts = relay.counts
        total = counts.forwarded + counts.dropped
        rejected = [member.rejected() for member in members]
        late = sum(r["replayed"] for r in rejected)
        report(f"fleet of 3 through a relay dropping {counts.dropped / total:.1%} and reordering "
               f"{counts.reordered / total:.1%} of {total} datagrams ({late:.0f} overtaken by a newer one "
               f"from the same member, dropped as replayed): combined {rate:,.0f} B/s over the last 20 s "
               f"({rate / QUOTA:.3f}x)")
        assert counts.dropped > 0 and counts.reordered > 0
        assert 0.85 * QUOTA <= rate <= 1.10 * QUOTA, f"{rate:,.0f} B/s against {QUOTA:,}"
        assert all(r["bad_mac"] == r["malformed"] == r["stale"] == r["other_fleet"] == 0 for r in rejected)


#: How many times, and how far apart, the consumer test reads each member's rates at the run's end.
VIEWS = 5
VIEW_EVERY_S = 2.0


def test_consumers_of_one_group_over_three_proxies(kafka_cluster: LocalKafka, tmp_path: Path) -> None:
    """Three consumers of one group, one client id, each through its own proxy: one consumer quota
    for the three, every record consumed exactly once across rebalances."""
    quota = 1_200_000
    with ExitStack() as stack:
        members, _ports, _relay = static_fleet(stack, kafka_cluster, tmp_path,
                                               quota_text(consumer_byte_rate=quota))
        topic = _topic(kafka_cluster.bootstrap, "fleet-c")
        total = _fill(kafka_cluster.bootstrap, topic, 45, **{"batch.size": 16_384})  # 45 MB: > 30 s at quota
        started = time.monotonic()
        consumers = [GroupConsumer(m.bootstrap, topic, started) for m in members]
        time.sleep(RUN_S - VIEWS * VIEW_EVERY_S)
        # Each member's view while the consumers still read (once they stop, the local windowed rate
        # decays towards 0 over the quota window), several times: a consumer can be idle at one
        # instant (h65: two of three read 214 and 0 B/s at a single scrape, mid-rebalance perhaps).
        views: list[list[tuple[float, float]]] = [[] for _ in members]
        for _ in range(VIEWS):
            time.sleep(VIEW_EVERY_S)
            for member, seen_by in zip(members, views, strict=True):
                samples = member.metrics()  # both rates from one scrape: one instant
                fleet = summed(samples, "kthrottle_fleet_fetch_byte_rate_bytes_per_second", **FETCH_LABELS)
                local = summed(samples, "kthrottle_fetch_byte_rate_bytes_per_second", **FETCH_LABELS)
                seen_by.append((fleet, local))
        throttles = [member.metric("kthrottle_throttles_total", **FETCH_LABELS) for member in members]
        for consumer in consumers:
            consumer.stop()
        for consumer in consumers:
            assert not consumer.errors, consumer.errors[:3]
            assert consumer.records, "a consumer got no partitions"
        received = summed_rate([c.received for c in consumers], RUN_S - 20, RUN_S, started)
        report(f"fleet of 3, 3 librdkafka consumers of one group: quota {quota:,} B/s, received "
               f"{received:,.0f} B/s over the last 20 s ({received / quota:.3f}x)")
        assert 0.9 * quota <= received <= 1.05 * quota, f"{received:,.0f} B/s against {quota:,}"
        seen: dict[int, list[int]] = {}
        for consumer in consumers:
            for partition, offset in consumer.records:
                seen.setdefault(partition, []).append(offset)
        consumed = sum(len(offsets) for offsets in seen.values())
        assert consumed < total
        for partition, offsets in seen.items():
            assert sorted(offsets) == list(range(len(offsets))), f"partition {partition}: gaps or repeats"
        # every member throttled, and at some view carried traffic of its own while it saw more
        # across the fleet: the exchange reached it
        assert all(count > 0 for count in throttles), throttles
        for seen_by in views:
            assert any(fleet > local > 0 for fleet, local in seen_by), views


#: How long the two members left are measured once the dead one's usage has faded. The producers'
#: deliveries come in lumps of 1-1.9 MB a second after each throttle (h31), so over 10 s one lump
#: more read 1.063x; over 20 s, as the other accuracy runs measure, it is half that.
HELD_S = 20.0


def test_a_member_killed_and_one_joining_mid_run(kafka_cluster: LocalKafka, tmp_path: Path) -> None:
    """kill -9 one of three: the other two hold the combined rate once its usage has faded out;
    a fourth starts mid-run with its own producer: no burst above 1.10x."""
    with ExitStack() as stack:
        quotas = quota_text(producer_byte_rate=QUOTA)
        members, ports, _relay = static_fleet(stack, kafka_cluster, tmp_path, quotas, spare=1)
        topic = _topic(members[0].bootstrap, "fleet-kill")
        started = time.monotonic()
        producers = [GreedyProducer(m.bootstrap, topic, started) for m in members]
        for producer in producers:
            stack.callback(producer.stop, True)  # a failed assertion must not leave them running
        time.sleep(10)
        killed_at = time.monotonic() - started
        members[2].kill()
        producers[2].stop(abandon=True)
        faded = killed_at + DEAD_MEMBER_FADES_S
        time.sleep(max(0.0, started + faded + HELD_S - time.monotonic()))
        peers = [f"127.0.0.1:{p}" for p in ports[:3]]
        fourth = Member(kafka_cluster.bootstrap, tmp_path, quotas, udp_port=ports[3], peers=peers)
        stack.callback(fourth.stop)
        joined_at = time.monotonic() - started
        producers.append(GreedyProducer(fourth.bootstrap, topic, started))
        stack.callback(producers[-1].stop, True)
        time.sleep(11)
        for producer in (producers[0], producers[1], producers[3]):
            producer.stop()
        everyone = combined(started, producers)
        after_kill = everyone.rate(killed_at + 3, killed_at + 13)
        held = everyone.rate(faded, faded + HELD_S)
        after_join = everyone.rate(joined_at, joined_at + 10)
        report(f"kill -9 of 1 of 3 members at {killed_at:.0f} s: {after_kill / QUOTA:.3f}x over the 10 s "
               f"after one window, {held / QUOTA:.3f}x over {HELD_S:.0f} s once its usage faded "
               f"({DEAD_MEMBER_FADES_S:.0f} s); "
               f"a 4th member and producer joining at {joined_at:.0f} s: {after_join / QUOTA:.3f}x over 10 s")
        shape = f"acked kB per producer: {acked_timeline(started, producers, killed_at - 3, joined_at + 10)}"
        assert 0.9 * QUOTA <= held <= 1.05 * QUOTA, f"{held:,.0f} B/s held by the two left; {shape}"
        assert after_join <= 1.10 * QUOTA, f"{after_join:,.0f} B/s after the 4th joined; {shape}"
        assert producers[3].result.records > 0, "the 4th member's producer got nothing through"
        assert fourth.metric("kthrottle_fleet_members") == 3  # itself and the two alive
        assert fourth.metric("kthrottle_throttles_total", **PRODUCE_LABELS) > 0


def test_workers_share_one_producer_quota(kafka_cluster: LocalKafka, tmp_path: Path) -> None:
    """`kthrottle run --workers 2`: one producer's connections land on both workers (SO_REUSEPORT),
    which hold it to one quota; a worker killed with -9 is restarted."""
    member = Member(kafka_cluster.bootstrap, tmp_path, quota_text(producer_byte_rate=QUOTA), workers=2)
    with member, ExitStack() as cleanup:
        for worker in (0, 1):
            wait_until(lambda w=worker: member.metric("kthrottle_fleet_members", w) == 2, 10, "2 workers")
        topic = _topic(member.bootstrap, "fleet-workers")
        # The kernel picks a worker per connection: retry until each worker carries a fair part of
        # the producer's bytes (a worker holding only the bootstrap connection, or one leader's of
        # three, would make "each member shows the fleet's rate" say little; h5 saw 89 % / 11 %).
        for _attempt in range(8):
            started = time.monotonic()
            producer = GreedyProducer(member.bootstrap, topic, started)
            cleanup.callback(producer.stop, True)
            time.sleep(3)
            local = [member.metric(LOCAL_PRODUCE_RATE, w, **PRODUCE_LABELS) for w in (0, 1)]
            if min(local) >= 0.25 * sum(local) > 0:
                break
            producer.stop(abandon=True)
        else:
            raise AssertionError(f"the producer's bytes never split over both workers (last {local})")
        sampler = RateSampler([(member, 0), (member, 1)], started, FLEET_PRODUCE_RATE, LOCAL_PRODUCE_RATE,
                              PRODUCE_LABELS)
        time.sleep(max(0.0, started + RUN_S - time.monotonic()))
        producer.stop()
        sampler.stop()
        rate = producer.result.rate(RUN_S - 20, RUN_S)
        report(f"--workers 2, one librdkafka producer over both: quota {QUOTA:,} B/s, measured "
               f"{rate:,.0f} B/s over the last 20 s ({rate / QUOTA:.3f}x)")
        # h41 read 0.877x once: say which worker carried what (fleet rate, own rate) when it happens
        shown = [sampler.mean(worker, RUN_S - 20, RUN_S) for worker in (0, 1)]
        assert 0.9 * QUOTA <= rate <= 1.05 * QUOTA, (
            f"{rate:,.0f} B/s against {QUOTA:,}; workers' (fleet, own) rates over those 20 s: "
            + ", ".join(f"{fleet:,.0f} / {own:,.0f}" for fleet, own in shown)
            + f"; librdkafka retries {producer.retries} ({producer.resend_events[:3]}); acked kB per second: "
            + acked_timeline(started, [producer], 0, RUN_S))
        assert_fleet_rate_shown(sampler, 2, rate, "--workers 2")
        pids = dict(re.findall(r"worker (\d) started \(pid (\d+)\)", member.log()))
        os.kill(int(pids["1"]), signal.SIGKILL)
        member.wait_for_log("worker 1 restarted", 10)
        assert re.search(r"worker 1 \(pid \d+\) was killed by signal 9 after [0-9.]+ s; restarting it in",
                         member.log())
        wait_until(lambda: member.metric_when_up("kthrottle_fleet_members", 1) == 2, 15,
                   "the restarted worker back")
        assert member.alive()


#: The producers run this long before ZooKeeper stops: one padded quota window (11 s) and a little.
WARMUP_S = 12
#: ZooKeeper stays down this long; the quota is measured over all of it but its first 2 s (20 s, as
#: the other accuracy runs measure: throttled deliveries come in lumps of 1-2 MB).
ZOOKEEPER_DOWN_S = 22


def test_zookeeper_membership_survives_an_outage(kafka_cluster: LocalKafka, tmp_path: Path) -> None:
    """Members found in ZooKeeper; ZooKeeper stopped mid-run: the two go on exchanging and hold the
    quota; started again: a third member registers and both others send to it."""
    chroot = f"/fleet-{uuid.uuid4().hex[:8]}"
    quotas = quota_text(producer_byte_rate=QUOTA)
    with running_zookeeper() as zookeeper, ExitStack() as stack:
        (tmp_path / "fleet.secret").write_text(os.urandom(32).hex())
        zk = (f'membership = "zookeeper"\nzookeeper = "{zookeeper.connect_string}"\n'
              f'zookeeper_chroot = "{chroot}"')

        def start() -> Member:
            member = Member(kafka_cluster.bootstrap, tmp_path, quotas, udp_port=free_udp_port(), fleet=zk)
            stack.callback(member.stop)
            return member

        members = [start(), start()]
        for member in members:
            wait_until(lambda m=member: m.metric("kthrottle_fleet_members") == 2, 10, "2 members")
        topic = _topic(members[0].bootstrap, "fleet-zk")
        started = time.monotonic()
        producers = [GreedyProducer(m.bootstrap, topic, started) for m in members]
        for producer in producers:
            stack.callback(producer.stop, True)  # a failed assertion must not leave them running
        # Past the first quota window: the producers' opening burst and the long throttles that pay it
        # back are behind (measured 8-18 s after the start, one run read 0.770x).
        time.sleep(WARMUP_S)
        zookeeper.stop()
        stopped_at = time.monotonic() - started
        received = members[0].metric("kthrottle_fleet_datagrams_received_total")
        time.sleep(ZOOKEEPER_DOWN_S)
        assert members[0].metric("kthrottle_fleet_datagrams_received_total") >= received + 10
        for member in members:
            assert member.metric("kthrottle_fleet_members") == 2
            assert member.metric("kthrottle_fleet_peer_addresses") == 1
        zookeeper.start()
        members.append(start())
        for member in members:
            wait_until(lambda m=member: m.metric("kthrottle_fleet_peer_addresses") == 2, 15, "3 in ZooKeeper")
            wait_until(lambda m=member: m.metric("kthrottle_fleet_members") == 3, 10, "3 members")
        for producer in producers:
            producer.stop()
        rate = combined(started, producers).rate(stopped_at + 2, stopped_at + ZOOKEEPER_DOWN_S)
        report(f"ZooKeeper membership, ZooKeeper down for {ZOOKEEPER_DOWN_S} s: 2 producers held at "
               f"{rate / QUOTA:.3f}x the quota meanwhile")
        assert 0.85 * QUOTA <= rate <= 1.10 * QUOTA, f"{rate:,.0f} B/s against {QUOTA:,}"
        assert "fleet membership: ZooKeeper at" in members[0].log()


def test_a_member_whose_zookeeper_session_expired_registers_again(kafka_cluster: LocalKafka,
                                                                 tmp_path: Path) -> None:
    """ZooKeeper keeps running but one member is cut off from it (a relay the test cuts) for longer
    than its session timeout: ZooKeeper expires the session and deletes its znode, so the other
    member stops listing it, yet the two go on exchanging usage; once the member reaches ZooKeeper
    again it gets a new session, registers again, and the other member lists it again."""
    chroot = f"/fleet-{uuid.uuid4().hex[:8]}"
    members_path = f"{chroot}/kthrottle/fleets/{FLEET}/members"
    quotas = quota_text(producer_byte_rate=QUOTA)
    with running_zookeeper() as zookeeper, ExitStack() as stack:
        host, port = zookeeper.connect_string.rsplit(":", 1)
        relay = TcpRelay((host, int(port)))
        stack.callback(relay.close)
        (tmp_path / "fleet.secret").write_text(os.urandom(32).hex())

        def start(connect: str) -> Member:
            zk = f'membership = "zookeeper"\nzookeeper = "{connect}"\nzookeeper_chroot = "{chroot}"'
            member = Member(kafka_cluster.bootstrap, tmp_path, quotas, udp_port=free_udp_port(), fleet=zk)
            stack.callback(member.stop)
            return member

        cut_off = start("{}:{}".format(*relay.address))
        other = start(zookeeper.connect_string)
        for member in (cut_off, other):
            wait_until(lambda m=member: m.metric("kthrottle_fleet_peer_addresses") == 1, 15, "listed")
        with kazoo_client(zookeeper.connect_string) as watcher:
            assert len(watcher.get_children(members_path)) == 2
            relay.cut()
            # kazoo asks for a 10 s session; ZooKeeper expires it some ticks after that
            wait_until(lambda: len(watcher.get_children(members_path)) == 1, 30,
                       "the cut-off session expired")
            wait_until(lambda: other.metric("kthrottle_fleet_peer_addresses") == 0, 10,
                       "the other member stops listing it")
            received = other.metric("kthrottle_fleet_datagrams_received_total")
            # idle members still send a full report (a heartbeat) every second
            wait_until(lambda: other.metric("kthrottle_fleet_datagrams_received_total") >= received + 2, 5,
                       "the cut-off member's reports to keep arriving while it is not listed")
            assert other.metric("kthrottle_fleet_members") == 2
            assert "ZooKeeper session lost" not in cut_off.log()  # kazoo cannot know yet
            relay.restore()
            wait_until(lambda: "registered again as" in cut_off.log(), 30, "registered again")
            wait_until(lambda: len(watcher.get_children(members_path)) == 2, 10, "two znodes again")
            wait_until(lambda: other.metric("kthrottle_fleet_peer_addresses") == 1, 10,
                       "the other member lists it again")
            wait_until(lambda: cut_off.metric("kthrottle_fleet_peer_addresses") == 1, 10,
                       "it lists the other member again")
        log = cut_off.log()
        assert "ZooKeeper session lost" in log, log[-3000:]
        assert relay.refused > 0


@pytest.mark.parametrize("over", ["plaintext", "tls"])
def test_members_without_a_name_find_each_other_by_the_cluster_id(kafka_cluster: LocalKafka, tmp_path: Path,
                                                                  over: str) -> None:
    """No fleet.name: each member reads the cluster id from its upstream (over TLS with
    [upstream_tls]) and names the fleet after it, so two proxies in front of one cluster form one
    fleet with nothing but each other's address configured."""
    (tmp_path / "fleet.secret").write_text(os.urandom(32).hex())
    upstream, tls = kafka_cluster.bootstrap, ""
    if over == "tls":
        assert kafka_cluster.ssl_bootstrap is not None and kafka_cluster.certificates is not None
        upstream = kafka_cluster.ssl_bootstrap
        tls = f'[upstream_tls]\nca = "{kafka_cluster.certificates.ca}"\n\n'
    ports = [free_udp_port(), free_udp_port()]
    with ExitStack() as stack:
        members = []
        for port, other in zip(ports, reversed(ports), strict=True):
            member = Member(upstream, tmp_path, quota_text(producer_byte_rate=QUOTA), udp_port=port,
                            peers=[f"127.0.0.1:{other}"], name=None, upstream_tls=tls)
            stack.callback(member.stop)
            members.append(member)
        for member in members:
            wait_until(lambda m=member: m.metric("kthrottle_fleet_members") == 2, 15, "2 members")
            assert f"fleet {kafka_cluster.cluster_id!r}: member" in member.log()
        assert not any(members[0].rejected().values()), members[0].rejected()


# -- consumers ------------------------------------------------------------------------------------------


class GroupConsumer:
    """A consumer of one group on its own thread: offsets seen, and bytes received over time.

    Offsets are committed synchronously whenever partitions are taken away, so a rebalance hands
    a partition over exactly where this consumer stopped (every record once across the group).
    """

    def __init__(self, bootstrap: str, topic: str, started: float) -> None:
        self.records: list[tuple[int, int]] = []
        self.errors: list[str] = []
        self.received: list[tuple[float, int]] = []
        self.started = started
        self._consumer = Consumer({
            "bootstrap.servers": bootstrap, "group.id": f"{topic}-group", "client.id": CONSUMER,
            "auto.offset.reset": "earliest", "statistics.interval.ms": 100, "stats_cb": self._stats,
            "max.partition.fetch.bytes": 65_536})
        self._consumer.subscribe([topic], on_revoke=self._revoked)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _stats(self, text: str) -> None:
        brokers = json.loads(text).get("brokers", {}).values()
        self.received.append((time.monotonic(), sum(int(b.get("rxbytes", 0)) for b in brokers)))

    @staticmethod
    def _revoked(consumer: Consumer, _partitions: list[TopicPartition]) -> None:
        with contextlib.suppress(KafkaException):  # nothing consumed yet: nothing to commit
            consumer.commit(asynchronous=False)

    def _run(self) -> None:
        while not self._stop.is_set():
            for message in self._consumer.consume(500, timeout=0.2):
                if message.error():
                    if message.error().code() != KafkaError._PARTITION_EOF:
                        self.errors.append(str(message.error()))
                    continue
                self.records.append((message.partition(), message.offset()))
        self._consumer.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)


def summed_rate(series: list[list[tuple[float, int]]], start_s: float, end_s: float, started: float) -> float:
    """The slope of the consumers' bytes received together, each interpolated on one 0.1 s grid."""
    def at(points: list[tuple[float, int]], t: float) -> float:
        before = [(pt, b) for pt, b in points if pt <= t]
        after = [(pt, b) for pt, b in points if pt > t]
        if not before:
            return float(after[0][1]) if after else 0.0
        if not after:
            return float(before[-1][1])
        (t0, b0), (t1, b1) = before[-1], after[0]
        return b0 + (b1 - b0) * (t - t0) / (t1 - t0)

    grid = [started + start_s + i * 0.1 for i in range(int((end_s - start_s) * 10) + 1)]
    return slope([(t, sum(at(points, t) for points in series)) for t in grid])

