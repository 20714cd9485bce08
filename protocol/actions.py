"""What a `ProxyConnection` asks the I/O layer to do.

The connection decides and `proxy/` carries out, as in h11's events. They live in their own
module so the I/O layer and the connection's helper modules share them without import cycles.
"""

from __future__ import annotations

from dataclasses import dataclass

from .broker_array import Address
from .client_quotas import QuotaAdminRequest


@dataclass(slots=True)
class ToBroker:
    """Write these chunks to the broker (`writelines`), `delay_ms` from now.

    A delay holds requests whose quota bucket is throttled; writes keep their order.
    """

    chunks: list[bytes]
    delay_ms: int = 0


@dataclass(slots=True)
class ToClient:
    """Write these chunks to the client (`writelines`), `delay_ms` from now (throttle_mode "delay").

    Writes keep their order: a later ToClient never overtakes a delayed one.
    """

    chunks: list[bytes]
    delay_ms: int = 0


@dataclass(slots=True)
class Mute:
    """Stop reading from the client for `ms` (KIP-219: the client waits out its throttle)."""

    ms: int


@dataclass(slots=True)
class AwaitSlot:
    """A counted request waits for a slot at its broker (quotas/broker_concurrency.py): stop reading the
    client until `ProxyConnection.slot_granted`, as a broker reads nothing from a muted socket."""


@dataclass(slots=True)
class Close:
    """Close both sides; `reason` names what was wrong, for the log."""

    reason: str


@dataclass(slots=True)
class BrokersSeen:
    """Real broker addresses learned from a response, by node id."""

    addresses: dict[int, Address]


@dataclass(slots=True)
class Authenticated:
    """The broker accepted a SASL exchange; `principal` is now the connection's user."""

    principal: str
    mechanism: str


@dataclass(slots=True)
class Throttled:
    """A quota throttled this request (for logs and metrics)."""

    api_key: int
    throttle_ms: int


@dataclass(slots=True)
class QuotaAdmin:
    """A DescribeClientQuotas / AlterClientQuotas request the proxy answers itself.

    The I/O layer checks `principal`, consults or changes the quota store, and hands the
    response frame back with `ProxyConnection.answer_quota_admin`. Until then later requests on
    this connection wait, as they would behind a request a broker is still processing.
    """

    correlation_id: int
    api_key: int
    api_version: int
    request: QuotaAdminRequest
    principal: str


Action = (ToBroker | ToClient | Close | BrokersSeen | Authenticated | Mute | Throttled | QuotaAdmin
          | AwaitSlot)

__all__ = [
    "Action", "Authenticated", "AwaitSlot", "BrokersSeen", "Close", "Mute", "QuotaAdmin", "Throttled",
    "ToBroker",
    "ToClient",
]
