"""A large Fetch response passed to the client as it arrives, instead of being buffered whole.

The connection decides whether a response may stream (its size, the quotas, the partition
throttles); this holds what one stream needs once started: how much of it is still to come, and
for v16+ the `FetchStream` that rewrites the NodeEndpoints at its end (fetch_stream.py).
"""

from __future__ import annotations

from collections.abc import Mapping

from .actions import Action, BrokersSeen, ToClient
from .addresses import needs_rewrite
from .apis import ApiKey
from .broker_array import Address, Advertise
from .fetch_stream import FetchStream, node_endpoints_slack
from .in_flight import InFlight
from .in_flight import size_prefix as _size


class Passthrough:
    """One response streaming to the client: `feed` it the broker's bytes until `remaining` is 0."""

    __slots__ = ("_stream", "announced_size", "entry", "remaining")

    def __init__(self, entry: InFlight, size: int, head: bytes, advertise: Advertise,
                 brokers: Mapping[int, Address] | None, actions: list[Action]) -> None:
        """Start with the response's buffered `head` (header first, no size prefix) of `size` bytes:
        its size prefix and head go into `actions`."""
        self.entry = entry
        self.remaining = size - len(head)
        self._stream: FetchStream | None = None
        self.announced_size = size
        if not needs_rewrite(ApiKey.FETCH, entry.api_version):
            actions.append(ToClient([_size(size), head]))
            return
        # NodeEndpoints may follow the records: the size announced now leaves room for them.
        stream = FetchStream(size, advertise, node_endpoints_slack(advertise, brokers))
        self._stream = stream
        self.announced_size = stream.announced_size
        actions.append(ToClient([_size(stream.announced_size)]))
        self._pass(head, actions)

    def feed(self, data: bytes, actions: list[Action]) -> bytes:
        """Pass on what of `data` belongs to this response; returns the rest (the next responses)."""
        take = min(self.remaining, len(data))
        self.remaining -= take
        if self._stream is None:
            actions.append(ToClient([data[:take]]))
        else:
            self._pass(data[:take], actions)
        return data[take:]

    def _pass(self, data: bytes, actions: list[Action]) -> None:
        assert self._stream is not None
        chunks = self._stream.feed(data)
        if self._stream.discovered:  # before the tail goes out: the client may connect at once
            actions.append(BrokersSeen(self._stream.discovered))
        if chunks:
            actions.append(ToClient(chunks))


__all__ = ["Passthrough"]
