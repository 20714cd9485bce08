"""Opening `[proxy] quota_store = "kafka"`: the quota topic's store, tied to a running proxy (issue 26).

`config.kafka_quotas` reads and writes the topic; this module gives it the proxy's upstream address,
TLS and `[control_plane]` login, hands every table it reads to the quota engine on the event loop,
counts the records it skips, and decides what a start without the topic means:

- the cluster refused the principal (an ACL): the proxy does not start, and the one-line error names
  the topic and the ACLs it needs;
- the cluster is out of reach: the proxy serves with the file's `[[quota]]` tables, logs that it
  does, and keeps trying; once the topic is read, its quotas replace the file's.

The topic's capacity record, when there is one, replaces the file's `[capacity]` while the proxy
runs (proxy/capacity/live.py); when it is removed, the file's applies again.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from prometheus_client import Counter

from config.capacity import capacity_from_config_form
from config.cluster_login import client_configs
from config.common import SettingsError
from config.kafka_quotas import KafkaQuotaError, KafkaQuotas
from config.quota_records import Refused
from quotas.engine import QuotaTable

if TYPE_CHECKING:
    from config.settings import ProxySettings
    from proxy.server import ProxyServer

log = logging.getLogger("kthrottle.admin")

#: Between two tries to read the topic, after a start that could not reach the cluster.
RETRY_SECONDS = 5.0
#: How long a start waits for the cluster before serving with the file's quotas.
START_TIMEOUT_SECONDS = 15.0

_TRYING: set[asyncio.Task[None]] = set()


async def open_kafka_quotas(settings: ProxySettings, server: ProxyServer,
                            from_file: QuotaTable) -> KafkaQuotas:
    """The started store, or one still trying in the background (the file's quotas in force meanwhile)."""
    assert settings.fleet is not None  # settings.check: the records are signed with the fleet secret
    loop = asyncio.get_running_loop()
    refused = Counter("kthrottle_quota_records_skipped", "Records of the quota topic that changed nothing: "
                      "forged (bad signature), malformed, invalid or replayed", ["reason"],
                      registry=server.metrics.registry)

    def on_change(table: QuotaTable) -> None:  # on the store's thread
        loop.call_soon_threadsafe(_apply, server, table)

    def on_refused(record: Refused) -> None:  # on the store's thread; the store has logged it
        refused.labels(record.reason.value).inc()

    def on_capacity(values: dict[str, str] | None) -> None:  # on the store's thread, checked already
        # none in the topic: the config file's [capacity] (or none) applies again
        config = settings.capacity if values is None else capacity_from_config_form(values)
        loop.call_soon_threadsafe(server.capacity.apply, config)

    plane = settings.control_plane
    configs = client_configs(settings.upstream, server.upstream_tls_context(), plane.login,
                             "kthrottle-quotas", request_timeout_ms=10_000, bootstrap_timeout_ms=10_000)
    store = KafkaQuotas(configs, settings.fleet.secret, topic=plane.quota_topic, on_change=on_change,
                        on_refused=on_refused, on_capacity=on_capacity, timeout=START_TIMEOUT_SECONDS)
    try:
        await loop.run_in_executor(None, store.start)
        return store
    except KafkaQuotaError as exc:
        if exc.fatal:
            raise SettingsError(str(exc)) from exc
        log.warning("%s; serving with the %d quota entit%s of the file until the topic can be read",
                    exc, len(from_file), "y" if len(from_file) == 1 else "ies")
    server.engine.set_quotas(from_file)
    task = loop.create_task(_keep_trying(store), name="kthrottle-quota-topic-start")
    _TRYING.add(task)  # held until done: the loop keeps only weak references to tasks
    task.add_done_callback(_TRYING.discard)
    return store


async def _keep_trying(store: KafkaQuotas) -> None:
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(RETRY_SECONDS)
        if store.stopped:
            return
        try:
            await loop.run_in_executor(None, store.start)
        except KafkaQuotaError as exc:
            log.warning("%s (trying again in %.0f s)", exc, RETRY_SECONDS)
            continue
        log.info("the quota topic %s is read: its quotas replace the file's", store.topic)
        return


def _apply(server: ProxyServer, table: QuotaTable) -> None:
    server.engine.set_quotas(table)
    log.info("quotas from the quota topic: %d entit%s", len(table), "y" if len(table) == 1 else "ies")


__all__ = ["open_kafka_quotas"]
