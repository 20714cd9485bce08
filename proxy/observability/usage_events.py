"""Usage events: every interval, one JSON record per active (user, client-id) to the cluster (issue 14).

The quota engine counts every charge in a `quotas.usage.UsageAccount`; every `[usage] interval_ms`
(aligned to wall-clock multiples, so proxies' intervals line up) this writer takes the interval,
resolves the quotas in force for each entity, encodes the events (their schema and encoding:
proxy/observability/usage_event_schema.py) on the event loop a slice at a time, and hands them to
one thread that owns a kafka-python KafkaProducer (enable_idempotence, acks=all) bootstrapped
straight at the cluster, not through the proxy's listeners, so the events are never charged to
anyone. Nothing here runs on the request path:

- The thread waits for the cluster, never the loop. Intervals wait in a queue bounded by
  `max_pending_intervals` and `buffer_memory` (bytes queued plus bytes handed to the producer and not
  yet acknowledged); past either, the oldest interval is dropped and its events counted in
  `kthrottle_usage_events_dropped_total{reason="pending_full"}`.
- A record handed to the producer is never handed over again: the idempotent producer retries it
  without duplicates until `delivery.timeout.ms`, after which it counts as dropped ("send_failed").
  So no event is ever written twice, and an interval is either whole, partly dropped (counted), or
  absent (counted).
- On shutdown the current interval is taken and sent with a bounded wait (SHUTDOWN_TIMEOUT_S); what
  cannot be sent by then is lost. A restart loses at most the current interval.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from config.cluster_login import client_configs
from config.settings import Address, ProxySettings
from config.usage import UsageSettings
from quotas.engine import QuotaEngine
from quotas.usage import UsageAccount

from .usage_event_schema import ProxyIdentity, encode_events

log = logging.getLogger("kthrottle.usage")

#: Entities encoded per slice on the event loop before it serves connections again (~5 ms each).
ENCODE_SLICE = 1000
#: Kafka's producer max.block.ms is 60 s; the writer's thread blocks no longer than this in one
#: send while the cluster is away, so it notices a shutdown soon.
MAX_BLOCK_MS = 5_000
#: Kafka's producer delivery.timeout.ms default (2 minutes): a record not acknowledged by then is
#: dropped (counted), never sent again by the writer.
DELIVERY_TIMEOUT_MS = 120_000
#: How long to wait before connecting again after the cluster could not be reached (Kafka's
#: reconnect.backoff.max.ms is 1 s; this is a background writer, so it waits longer).
RECONNECT_BACKOFF_S = 2.0
#: How long reaching the cluster may take (Kafka's socket.connection.setup.timeout.max.ms is 30 s).
BOOTSTRAP_TIMEOUT_MS = 10_000
#: Records wait this long for others to share a batch (Kafka's linger.ms; 5 ms since Kafka 4.0).
LINGER_MS = 50
#: The bounded wait for the last interval at shutdown (inside the 10 s a supervisor usually allows).
SHUTDOWN_TIMEOUT_S = 5.0


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


class UsageMetrics:
    """The writer's metrics, on the proxy's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.sent = Counter("kthrottle_usage_events_sent",
                            "Usage events the cluster acknowledged", registry=registry)
        self.dropped = Counter(
            "kthrottle_usage_events_dropped",
            "Usage events not written: 'pending_full' (the oldest interval waiting for a slow or absent "
            "cluster, past max_pending_intervals or buffer_memory), 'send_failed' (not acknowledged "
            "within delivery.timeout.ms), 'shutdown' (still waiting when the proxy stopped)",
            ["reason"], registry=registry)
        for reason in ("pending_full", "send_failed", "shutdown"):
            self.dropped.labels(reason)
        self.intervals = Counter("kthrottle_usage_intervals",
                                 "Usage intervals taken (each gives one event per active entity)",
                                 registry=registry)
        self.folded = Counter("kthrottle_usage_entities_folded",
                              "Entities counted under __other__ because an interval reached its "
                              "entity cap (quotas.usage.MAX_USAGE_ENTITIES)", registry=registry)
        self.pending = Gauge("kthrottle_usage_pending_events",
                             "Usage events waiting for the cluster or in flight to it", registry=registry)


@dataclass(slots=True)
class _Batch:
    seq: int
    records: list[tuple[bytes, bytes]]
    size: int


class _Sender:
    """The thread that owns the producer; the loop only calls `offer` and `stop`."""

    def __init__(self, usage: UsageSettings, bootstrap: list[Address],
                 tls: Callable[[], ssl.SSLContext | None], metrics: UsageMetrics) -> None:
        self.usage = usage
        self.bootstrap = bootstrap
        self.tls = tls
        self.metrics = metrics
        self._cond = threading.Condition()
        self._pending: collections.deque[_Batch] = collections.deque()
        self._queued_bytes = 0
        self._queued_events = 0
        #: handed to the producer, not yet acknowledged or failed (callbacks run on its thread)
        self._in_flight_bytes = 0
        self._in_flight_events = 0
        self._stopping = False
        self._closed = False
        #: the thread is reaching the cluster (a bootstrap blocks up to BOOTSTRAP_TIMEOUT_MS)
        self._connecting = False
        self._deadline = 0.0
        self._producer: Any = None
        self._thread = threading.Thread(target=self._run, name="kthrottle-usage", daemon=True)
        self.metrics.pending.set_function(lambda: self._queued_events + self._in_flight_events)

    def start(self) -> None:
        self._thread.start()

    def offer(self, batch: _Batch) -> None:
        """Queue an interval's records; drop the oldest intervals past the bounds (never blocks long)."""
        dropped = 0
        with self._cond:
            self._pending.append(batch)
            self._queued_bytes += batch.size
            self._queued_events += len(batch.records)
            usage = self.usage
            while self._pending and (len(self._pending) > usage.max_pending_intervals
                                     or self._queued_bytes + self._in_flight_bytes > usage.buffer_memory):
                old = self._pending.popleft()
                self._queued_bytes -= old.size
                self._queued_events -= len(old.records)
                dropped += len(old.records)
            self._cond.notify()
        if dropped:
            self.metrics.dropped.labels("pending_full").inc(dropped)
            log.warning("usage events: %d dropped, the cluster is too slow or away (pending intervals at "
                        "max_pending_intervals = %d or buffer_memory = %d)", dropped,
                        self.usage.max_pending_intervals, self.usage.buffer_memory)

    def stop(self, timeout_s: float) -> None:
        """Send what is queued within `timeout_s`, then close (called from an executor thread).

        A thread still reaching the cluster has nothing handed to a producer, and kafka-python's
        bootstrap cannot be interrupted: it is left to end on its own (a daemon thread) and what
        waits for it counts as lost now, so shutdown does not wait out a bootstrap to an
        unreachable cluster (h38: the proxy outlived a supervisor's 10 s)."""
        with self._cond:
            self._stopping = True
            self._deadline = time.monotonic() + timeout_s
            self._cond.notify()
        end = self._deadline + 1.0
        while self._thread.is_alive() and not self._connecting and time.monotonic() < end:
            self._thread.join(0.05)
        if self._thread.is_alive():
            self._count_lost()

    # -- the thread ---------------------------------------------------------------------------------

    def _left_s(self) -> float:
        return max(self._deadline - time.monotonic(), 0.0) if self._stopping else float("inf")

    def _wait(self, seconds: float) -> None:
        with self._cond:
            self._cond.wait(min(seconds, self._left_s()))

    def _run(self) -> None:
        try:
            while True:
                if self._producer is None:  # at once, not at the first event: a bad setting shows early
                    if self._stopping and not self._pending:
                        break
                    self._connecting = True
                    try:
                        self._producer = self._connect()
                    finally:
                        self._connecting = False
                    if self._producer is None:
                        if self._stopping:
                            break
                        self._wait(RECONNECT_BACKOFF_S)
                        continue
                with self._cond:
                    while not self._pending and not self._stopping:
                        self._cond.wait()
                    if not self._pending or self._left_s() <= 0.0:
                        break
                    batch = self._pending.popleft()
                    self._queued_bytes -= batch.size
                    self._queued_events -= len(batch.records)
                rest = self._send(batch)
                if rest is not None:
                    with self._cond:  # not all handed over: it waits again at the head, droppable
                        self._pending.appendleft(rest)
                        self._queued_bytes += rest.size
                        self._queued_events += len(rest.records)
                    self._wait(0.1 if self._in_flight_bytes else RECONNECT_BACKOFF_S)
        except Exception:  # a bug must not go unnoticed, nor take the proxy down
            log.exception("usage events: the writer stopped")
        finally:
            self._close()

    def _close(self) -> None:
        producer, self._producer = self._producer, None
        if producer is not None:
            try:
                producer.flush(timeout=max(min(self._left_s(), SHUTDOWN_TIMEOUT_S), 0.1))
            except Exception as exc:  # a timeout or a closed connection: counted below
                log.warning("usage events: not all acknowledged at shutdown: %s", exc)
            with contextlib.suppress(Exception):  # closing at shutdown; nothing left to do
                producer.close(timeout=0.5)
        self._count_lost()

    def _count_lost(self) -> None:
        """Count what was not written as lost, once (by the thread's close or by `stop`)."""
        with self._cond:
            if self._closed:
                return
            lost = self._queued_events + self._in_flight_events
            self._closed = True  # a late callback of a record counted here counts nothing more
            self._pending.clear()
            self._queued_bytes = self._queued_events = 0
        if lost:
            self.metrics.dropped.labels("shutdown").inc(lost)
            log.warning("usage events: %d not written at shutdown", lost)

    def _client_configs(self) -> dict[str, Any]:
        return client_configs(self.bootstrap, self.tls(), self.usage.login, "kthrottle-usage",
                              bootstrap_timeout_ms=BOOTSTRAP_TIMEOUT_MS, request_timeout_ms=30_000)

    def _connect(self) -> Any:
        """A producer, after the topic is known to exist (created if missing); None if unreachable."""
        from kafka import KafkaAdminClient, KafkaProducer
        from kafka.errors import KafkaError, TopicAlreadyExistsError

        configs = self._client_configs()
        try:
            admin = KafkaAdminClient(**configs)
            try:
                if self.usage.topic not in admin.list_topics():
                    self._create_topic(admin, TopicAlreadyExistsError)
            finally:
                admin.close()
            producer = KafkaProducer(**configs, enable_idempotence=True, acks="all", linger_ms=LINGER_MS,
                                     max_block_ms=MAX_BLOCK_MS, delivery_timeout_ms=DELIVERY_TIMEOUT_MS,
                                     allow_auto_create_topics=False)
        except (KafkaError, OSError, ValueError) as exc:
            log.warning("usage events: cannot reach the cluster at %s: %s (retrying)",
                        configs["bootstrap_servers"], exc)
            return None
        log.info("usage events: writing to topic %s at %s", self.usage.topic, configs["bootstrap_servers"])
        return producer

    def _create_topic(self, admin: Any, exists: type[Exception]) -> None:
        usage = self.usage
        replication = usage.replication_factor
        if replication > 0:
            brokers = len(admin.describe_cluster()["brokers"])
            replication = min(replication, max(brokers, 1))
        try:
            admin.create_topics({usage.topic: {"num_partitions": usage.partitions,
                                               "replication_factor": replication,
                                               "configs": {"retention.ms": str(usage.retention_ms)}}},
                                wait_for_metadata=True)
            log.info("usage events: created topic %s (%d partitions, replication factor %d, retention.ms %d)",
                     usage.topic, usage.partitions, replication, usage.retention_ms)
        except exists:
            pass  # another proxy made it first

    def _send(self, batch: _Batch) -> _Batch | None:
        """Hand the batch's records to the producer; what could not be handed over, or None."""
        from kafka.errors import KafkaError, KafkaTimeoutError

        producer = self._producer
        budget = self.usage.buffer_memory
        for index, (key, value) in enumerate(batch.records):
            size = len(key) + len(value)
            if self._in_flight_events and self._in_flight_bytes + size > budget:
                return self._rest(batch, index)
            try:
                future = producer.send(self.usage.topic, key=key, value=value)
            except KafkaTimeoutError as exc:  # no metadata within max.block.ms: the cluster is away
                log.warning("usage events: cannot send: %s (retrying)", exc)
                return self._rest(batch, index)
            except KafkaError as exc:  # the producer is in a fatal state (authorization, fencing): a new one
                log.warning("usage events: the producer failed: %s (connecting again)", exc)
                self._producer = None
                with contextlib.suppress(Exception):
                    producer.close(timeout=0)
                return self._rest(batch, index)
            with self._cond:
                self._in_flight_bytes += size
                self._in_flight_events += 1
            future.add_callback(self._acknowledged, size)
            future.add_errback(self._failed, size)
        return None

    @staticmethod
    def _rest(batch: _Batch, index: int) -> _Batch:
        records = batch.records[index:]
        return _Batch(batch.seq, records, sum(len(k) + len(v) for k, v in records))

    def _settle(self, size: int) -> bool:
        """One record acknowledged or failed; False when `_close` already counted it."""
        with self._cond:
            self._in_flight_bytes -= size
            self._in_flight_events -= 1
            return not self._closed

    # kafka-python's Future calls partial(f, *args)(value): the bound arguments come first
    def _acknowledged(self, size: int, _metadata: object) -> None:
        if self._settle(size):
            self.metrics.sent.inc()

    def _failed(self, size: int, exc: BaseException) -> None:
        if self._settle(size):
            self.metrics.dropped.labels("send_failed").inc()
            log.warning("usage events: one not acknowledged: %s", exc)


class UsageEventWriter:
    """Takes the usage interval on time and queues its events; see the module docstring."""

    def __init__(self, usage: UsageSettings, settings: ProxySettings, engine: QuotaEngine,
                 registry: CollectorRegistry, tls: Callable[[], ssl.SSLContext | None],
                 identity: ProxyIdentity) -> None:
        self.usage = usage
        self.engine = engine
        self.identity = identity
        self.metrics = UsageMetrics(registry)
        self.account = UsageAccount(wall_ms())
        self._sender = _Sender(usage, usage.bootstrap_servers or settings.upstream, tls, self.metrics)
        self._task: asyncio.Task[None] | None = None
        self._publishing = asyncio.Lock()

    def start(self) -> None:
        """Count from now and write every interval (call on the event loop)."""
        self.engine.usage = self.account
        self._sender.start()
        self._task = asyncio.get_running_loop().create_task(self._run())
        log.info("usage events every %d ms to topic %s", self.usage.interval_ms, self.usage.topic)

    async def _run(self) -> None:
        interval = self.usage.interval_ms
        while True:
            now = wall_ms()
            await asyncio.sleep((interval - now % interval) / 1000.0)
            await self.publish()

    async def publish(self, now_ms: int | None = None) -> int:
        """Take the interval ending now and queue its events; how many."""
        async with self._publishing:
            interval = self.account.take(wall_ms() if now_ms is None else now_ms)
            self.metrics.intervals.inc()
            if interval.folded_entities:
                self.metrics.folded.inc(interval.folded_entities)
            identity = self.identity.as_json()
            keys = list(interval.entities)
            records: list[tuple[bytes, bytes]] = []
            for start in range(0, len(keys), ENCODE_SLICE):
                if start:
                    await asyncio.sleep(0)
                records += encode_events(self.engine, identity, interval, keys[start:start + ENCODE_SLICE])
            if records:
                self._sender.offer(_Batch(interval.seq, records, sum(len(k) + len(v) for k, v in records)))
            return len(records)

    async def close(self) -> None:
        """Stop counting, queue the current interval and send what is queued, within SHUTDOWN_TIMEOUT_S."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.engine.usage = None  # what is counted from here on would be in no interval
        try:
            await self.publish()
        finally:
            await asyncio.get_running_loop().run_in_executor(None, self._sender.stop, SHUTDOWN_TIMEOUT_S)


__all__ = ["UsageEventWriter", "UsageMetrics"]
