"""Quotas in a compacted topic of the upstream cluster, shared by every proxy of a fleet (WIP, issue 26).

Why: Kafka 4 has no ZooKeeper. As Kafka Connect keeps its configuration in a compacted topic of the
cluster it serves, every member reads this topic from the beginning and follows it; an admin change
through any member is one signed record (``config.quota_records``), which every member applies when
it reads it. The topic has one partition, so its order is the one order every member applies.

- ``start`` makes sure the topic exists (created compacted with replication factor min(3, brokers)
  and ``min.insync.replicas`` 2 where there are 2 or more replicas; an existing topic must be
  compacted with one partition), reads it to its end, hands the table to ``on_change`` on the
  caller's thread, then follows it on a thread of its own.
- ``alter`` validates every change, writes one record per entity with acks=all, and returns once
  this member has read its own records back, so ``current`` includes them.
- While the cluster is away, the last table stays in force and ``alter`` fails naming the topic.

Threads: kafka-python's clients are used from one thread each: the consumer by ``start`` and then
the follower thread, the producer by ``alter`` (serialised by the admin service's lock).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from quotas.engine import QuotaTable
from quotas.entity import QuotaEntity
from quotas.types import ConfigKey

from .config_form import check_value, entity_path
from .quota_records import QuotaLog, QuotaRecord, Refused, capacity_record, quota_record, record_key

log = logging.getLogger("kthrottle.config.kafka_quotas")

DEFAULT_TOPIC = "__kthrottle_quotas"
#: How long one poll of the follower thread waits for records.
POLL_MS = 200
#: How often the follower asks the cluster for the topic's end, and how long it waits for it.
LIVENESS_CHECK_S = 1.0
LIVENESS_TIMEOUT_MS = 2000
#: How long a change waits for the cluster's acknowledgement (acks=all) before it is refused.
ALTER_TIMEOUT_S = 5.0
#: Between two looks at a quota topic whose partition the broker asked does not show yet.
TOPIC_METADATA_POLL_S = 0.2


class KafkaQuotaError(RuntimeError):
    """The quota topic could not be made, read or written; the message names the topic and what to do.

    `fatal`: waiting will not help (the cluster refused this principal, or the topic is not one
    a quota store can live in), as opposed to a cluster out of reach."""

    def __init__(self, message: str, *, fatal: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal


class KafkaQuotas:
    """The quota store of ``[proxy] quota_store = "kafka"`` (``proxy.admin.quota_admin.QuotaStore``)."""

    #: `alter` returns once its records are read back and the table handed on, in the topic's
    #: order: the admin service applying the change itself could overtake a later record
    applies_own_changes = True

    def __init__(self, client_configs: Mapping[str, Any], secret: bytes, *, topic: str = DEFAULT_TOPIC,
                 on_change: Callable[[QuotaTable], None], on_refused: Callable[[Refused], None] | None = None,
                 on_capacity: Callable[[dict[str, str] | None], None] | None = None,
                 timeout: float = 10.0) -> None:
        self._configs = dict(client_configs)
        self.topic = topic
        self._mac_key = record_key(secret)
        self._log = QuotaLog(self._mac_key)
        self._on_change = on_change
        self._on_capacity = on_capacity
        self._delivered_capacity: dict[str, str] | None = None
        self._on_refused = on_refused
        self._timeout = timeout
        self._lock = threading.Condition()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._consumer: Any = None
        self._producer: Any = None
        self._delivered: QuotaTable | None = None
        self.reachable = False

    @property
    def _where(self) -> str:
        return f"topic {self.topic} at {','.join(self._configs.get('bootstrap_servers', []))}"

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Topic checked or created, read to its end, the table delivered; then followed on a thread.

        Raises KafkaQuotaError (the store is left closed, and may be started again) when the topic
        cannot be made or read; `.fatal` tells a refusal or a wrong topic from an unreachable cluster."""
        from kafka import KafkaConsumer, KafkaProducer, TopicPartition
        from kafka.errors import KafkaError

        try:
            self._ensure_topic()
            consumer = KafkaConsumer(**self._configs, group_id=None, enable_auto_commit=False,
                                     auto_offset_reset="earliest")
            self._consumer = consumer
            partition = TopicPartition(self.topic, 0)
            consumer.assign([partition])
            consumer.seek_to_beginning(partition)
            end = consumer.end_offsets([partition], timeout_ms=int(self._timeout * 1000))[partition]
            self._read_until(end, time.monotonic() + self._timeout)
            self._producer = KafkaProducer(**self._configs, acks="all", enable_idempotence=True,
                                           max_in_flight_requests_per_connection=1,
                                           allow_auto_create_topics=False)
        except (KafkaError, KafkaQuotaError, OSError) as exc:
            self._close_clients()
            if isinstance(exc, KafkaQuotaError):
                raise
            raise KafkaQuotaError(self._explain("reading", exc), fatal=_denied(exc)) from exc
        self.reachable = True
        self._deliver()
        log.info("quotas live in %s: %d entities read up to offset %d", self._where,
                 len(self._log.entities), self._log.next_offset)
        self._thread = threading.Thread(target=self._follow, name="kthrottle-quota-topic", daemon=True)
        self._thread.start()

    @property
    def stopped(self) -> bool:
        return self._stopping.is_set()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(self._timeout)
        self._close_clients()

    def _close_clients(self) -> None:
        for client in (self._producer, self._consumer):
            if client is not None:
                try:
                    client.close(timeout=1)
                except Exception as exc:  # closing at shutdown: nothing left to do with it
                    log.debug("closing a quota-topic client: %s", exc)
        self._producer = self._consumer = None

    # ------------------------------------------------------------------ reading

    def current_capacity(self) -> dict[str, str] | None:
        """The capacity record's values (a `[capacity]` table's keys as strings), None without one."""
        with self._lock:
            return None if self._log.capacity is None else dict(self._log.capacity)

    def current(self) -> QuotaTable:
        with self._lock:
            return self._log.table()

    def _read_until(self, end: int, deadline: float) -> None:
        while self._log.next_offset < end:
            if time.monotonic() > deadline:
                raise KafkaQuotaError(f"{self._where}: read to offset {self._log.next_offset} of {end} "
                                      f"within {self._timeout:.0f} s")
            self._poll()

    def _poll(self) -> bool:
        """One poll of the consumer; whether any record was read."""
        batches = self._consumer.poll(timeout_ms=POLL_MS)
        read = False
        for records in batches.values():
            for record in records:
                with self._lock:
                    refused = self._log.apply(record.offset, record.key, record.value, record.headers or [])
                    self._lock.notify_all()
                read = True
                if refused is not None:
                    log.error("%s: skipped a record: %s", self._where, refused.describe())
                    if self._on_refused is not None:
                        self._on_refused(refused)
        position = self._consumer.position(next(iter(self._consumer.assignment())))
        with self._lock:  # past records that compaction removed, and past transaction markers
            if position is not None and position > self._log.next_offset:
                self._log.next_offset = position
                self._lock.notify_all()
        return read

    def _follow(self) -> None:
        """Poll for records; once a second ask for the end offset, which is how an absent cluster
        shows (kafka-python's poll just returns nothing while it reconnects)."""
        from kafka import TopicPartition
        from kafka.errors import KafkaError

        partition = TopicPartition(self.topic, 0)
        checked = 0.0
        while not self._stopping.is_set():
            try:
                if self._poll():
                    self._deliver()
                if time.monotonic() - checked >= LIVENESS_CHECK_S:
                    self._consumer.end_offsets([partition], timeout_ms=LIVENESS_TIMEOUT_MS)
                    checked = time.monotonic()
                    if not self.reachable:
                        log.warning("%s is back: quota changes are accepted again", self._where)
                    self.reachable = True
            except KafkaError as exc:
                if self.reachable:
                    log.warning("%s unreachable, the last quotas stay in force and changes are refused: "
                                "%r", self._where, exc)
                self.reachable = False
                checked = time.monotonic()
                self._stopping.wait(0.5)

    def _deliver(self) -> None:
        """Hand the table on if it changed. Under the lock, so the tables reach `on_change` (and,
        through `call_soon_threadsafe`, the event loop) in the order they were read, whichever of
        the follower and an `alter` gets here first."""
        with self._lock:
            table = self._log.table()
            if table != self._delivered:
                self._delivered = table
                self._on_change(table)
            capacity = self._log.capacity
            if self._on_capacity is not None and capacity != self._delivered_capacity:
                self._delivered_capacity = capacity
                self._on_capacity(None if capacity is None else dict(capacity))

    # ------------------------------------------------------------------ writing

    def alter(self, changes: Mapping[QuotaEntity, Mapping[ConfigKey, float | None]]) -> None:
        """Every change validated first, then one record per entity; returns once read back."""

        for entity, ops in changes.items():
            entity_path(entity)
            for quota_type, value in ops.items():
                if value is not None:
                    check_value(entity, quota_type, value)
        self._check_writable()
        table = self.current()
        records: list[tuple[str, QuotaRecord]] = []
        for entity, ops in changes.items():
            values = dict(table.get(entity, {}))
            for quota_type, value in ops.items():
                if value is None:
                    values.pop(quota_type, None)
                else:
                    values[quota_type] = value
            records.append((f"quotas for {entity.describe()}",
                            quota_record(entity, values, self._mac_key, int(time.time() * 1000))))
        self._write(records)

    def alter_capacity(self, changes: Mapping[str, str | None]) -> dict[str, str] | None:
        """Change keys of the fleet's capacity (None removes a key; none left removes the record, and
        the config file's `[capacity]` applies again); the values now in force in the topic."""
        values = dict(self.current_capacity() or {})
        for key, value in changes.items():
            if value is None:
                values.pop(key, None)
            else:
                values[key] = value
        record = capacity_record(values or None, self._mac_key, int(time.time() * 1000))  # checked here
        self._check_writable()
        self._write([("the capacity", record)])
        return self.current_capacity()

    def _check_writable(self) -> None:
        if self._producer is None:
            raise KafkaQuotaError(f"the quota store on {self._where} is not started (the cluster was "
                                  "unreachable at start): quotas not stored")
        if not self.reachable:
            raise KafkaQuotaError(f"{self._where} is unreachable: quotas not stored; the last quotas stay "
                                  "in force on every proxy until the cluster returns")

    def _write(self, records: list[tuple[str, QuotaRecord]]) -> None:
        """Send each record (acks=all) and return once this member has read them all back."""
        from kafka.errors import KafkaError, KafkaTimeoutError

        written = -1
        stored: list[str] = []
        for what, record in records:
            try:
                metadata = self._producer.send(self.topic, key=record.key, value=record.value,
                                               headers=list(record.headers)).get(timeout=ALTER_TIMEOUT_S)
            except KafkaError as exc:
                done = f" (already stored: {'; '.join(stored)})" if stored else ""
                if isinstance(exc, KafkaTimeoutError):
                    # The record may still be in the producer or in a stopped broker's socket: if the
                    # cluster took it, every member applies it when read, like any record.
                    why = (f"{self._where} is unreachable (no acknowledgement within {ALTER_TIMEOUT_S:g} s): "
                           f"{what} not stored{done}; the last quotas stay in force")
                    raise KafkaQuotaError(why) from exc
                why = self._explain(f"storing {what}", exc)
                raise KafkaQuotaError(why + done, fatal=_denied(exc)) from exc
            written = max(written, metadata.offset)
            stored.append(what)
        deadline = time.monotonic() + self._timeout
        with self._lock:
            while self._log.next_offset <= written:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise KafkaQuotaError(f"{self._where}: stored up to offset {written}, but not read back "
                                          f"within {self._timeout:.0f} s")
                self._lock.wait(left)
        self._deliver()

    # ------------------------------------------------------------------ the topic

    def _ensure_topic(self) -> None:
        from kafka import KafkaAdminClient
        from kafka.admin import ConfigResource, ConfigResourceType
        from kafka.errors import TopicAlreadyExistsError

        admin = KafkaAdminClient(**self._configs)
        try:
            if self.topic not in admin.list_topics():
                brokers = len(admin.describe_cluster()["brokers"])
                replication = min(3, max(brokers, 1))
                configs = {"cleanup.policy": "compact"}
                if replication >= 2:
                    configs["min.insync.replicas"] = "2"
                try:
                    admin.create_topics({self.topic: {"num_partitions": 1, "replication_factor": replication,
                                                      "configs": configs}}, wait_for_metadata=True)
                    log.info("created the quota topic %s: compacted, replication factor %d", self.topic,
                             replication)
                except TopicAlreadyExistsError:
                    pass  # another member made it first
            # A topic another member has just created may show no partitions yet on the broker
            # asked (its metadata not there yet; h30: two members starting at once): wait for it.
            deadline = time.monotonic() + self._timeout
            while True:
                (topic,) = admin.describe_topics([self.topic])
                partitions = len(topic["partitions"])
                if partitions or time.monotonic() >= deadline:
                    break
                time.sleep(TOPIC_METADATA_POLL_S)
            if partitions != 1:
                raise KafkaQuotaError(f"{self._where}: it has {partitions} partitions; the quota topic must "
                                      "have one, so that every member reads one order", fatal=True)
            described = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, self.topic)],
                                               config_filter="all")
            policy = _config_value(described, self.topic, "cleanup.policy")
            if policy != "compact":
                raise KafkaQuotaError(f"{self._where}: cleanup.policy is {policy!r}; the quota topic must "
                                      "be compacted (cleanup.policy=compact), or records would expire",
                                      fatal=True)
        finally:
            admin.close()

    def _explain(self, doing: str, exc: Exception) -> str:
        name = type(exc).__name__
        if _denied(exc):
            return (f"{doing} {self._where}: {name}: this principal needs Topic READ, WRITE, DESCRIBE "
                    f"and DESCRIBE_CONFIGS on {self.topic} (and CREATE on it or on the cluster, or the topic "
                    "made beforehand)")
        return f"{doing} {self._where} failed: {exc!r}"


def _denied(exc: Exception) -> bool:
    """Whether the cluster refused this principal (TopicAuthorizationFailed, ClusterAuthorization...)."""
    return "Authorization" in type(exc).__name__


def _config_value(described: Any, topic: str, name: str) -> str | None:
    """A topic config's value from kafka-python's DescribeConfigs answer:
    {resource type: {resource name: {config name: {"value": ...}}}}."""
    entry = described.get("topic", {}).get(topic, {}).get(name)
    value = entry.get("value") if isinstance(entry, dict) else None
    return str(value) if value is not None else None
