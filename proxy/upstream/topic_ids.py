"""The ids of throttled topics, learned from the cluster itself (KIP-73 partition throttles)."""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable

from config.common import Address
from protocol.topic_names import TopicNames
from quotas.partition_throttle import PartitionThrottles

from .discovery import fetch_topic_ids

log = logging.getLogger("kthrottle.partition_throttles")


#: How often the proxy asks the cluster for the ids of throttled topics it does not know yet.
TOPIC_ID_LOOKUP_INTERVAL_S = 5.0


class TopicIdResolver:
    """Learns the ids of throttled topics from the cluster itself (Metadata v10, no topic created).

    Fetch v13+ names topics by id and the operator names them: without this, a throttle added
    while a consumer runs (or after a restart) would apply from that consumer's next metadata
    refresh only, up to `metadata.max.age.ms` (5 minutes) later. On listeners that need
    authentication the lookup fails (the proxy holds no credentials) and the ids come from the
    clients' own Metadata responses, as before; that is logged once.
    """

    def __init__(self, upstream: list[Address], tls: Callable[[], ssl.SSLContext | None],
                 throttles: PartitionThrottles, topic_names: TopicNames) -> None:
        self._upstream = upstream
        self._tls = tls
        self._throttles = throttles
        self._names = topic_names
        self._task: asyncio.Task[None] | None = None
        self._next_s = 0.0
        self._warned = False

    def poll(self, now_s: float) -> None:
        """Start a lookup when a throttled topic's id is unknown (at most one per interval)."""
        if (self._task is not None and not self._task.done()) or now_s < self._next_s:
            return
        unknown = self._names.unknown(self._throttles.topics)
        if not unknown:
            return
        self._next_s = now_s + TOPIC_ID_LOOKUP_INTERVAL_S
        self._task = asyncio.get_running_loop().create_task(self._resolve(unknown))

    async def _resolve(self, topics: list[str]) -> None:
        try:
            found = await fetch_topic_ids(self._upstream, topics, self._tls())
        except ConnectionError as exc:
            if not self._warned:
                self._warned = True
                log.info("cannot read the ids of throttled topics from the cluster (%s): they are learned "
                         "from clients' Metadata responses instead", exc)
            return
        for name, topic_id in found.items():
            self._names.learn(topic_id, name)
