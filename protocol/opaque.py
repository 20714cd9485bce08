"""Quotas for the APIs kafka-python has no class for, whose bodies the proxy forwards unread.

A broker charges every request it handles to the request quota (KIP-124), whatever the API, so
the proxy charges an opaque request's time too: from the moment it went upstream until its
response came back. Where Kafka's schema puts `ThrottleTimeMs` first in the body (every opaque API
of Kafka 4.3.1 but the delegation-token and share-group-state ones, see `apis.OPAQUE_APIS`) the
throttle is written there, as for known APIs; elsewhere, and for API keys no schema describes,
muting the connection is the only signal (a broker mutes too, so the client waits either way).

ShareFetch (KIP-932) is charged like Fetch, as Kafka's `KafkaApis.handleShareFetchRequest` does:
its response bytes to the fetch byte rate (`consumer_byte_rate`) and its request time less its
`MaxWaitMs` long poll. One difference: a throttled Fetch is emptied of records (they are simply
fetched again), but a ShareFetch's records have been acquired for this consumer, and emptying them
would leave them locked until the acquisition lock times out (30 s by default) and count a
delivery attempt against them. So a throttled ShareFetch goes on with its records, its throttle
written in and the connection muted for it, which holds the consumer to its quota over time.
"""

from __future__ import annotations

from .apis import OPAQUE_APIS, ApiKey, api_name
from .broker_array import FieldError, read_string
from .charging import QuotaPolicy
from .errors import MalformedBody, MalformedHeader
from .headers import RequestHeader, response_body_offset
from .in_flight import InFlight

_INT32 = 2**31 - 1


def share_fetch_max_wait_ms(frame: bytes, header: RequestHeader) -> int:
    """A ShareFetch request's `MaxWaitMs`: after GroupId, MemberId and ShareSessionEpoch.

    ShareFetchRequest.json, every version (all flexible: compact nullable strings).
    """
    try:
        _group, pos = read_string(frame, header.body_offset, True, True, "group id")
        _member, pos = read_string(frame, pos, True, True, "member id")
    except FieldError as exc:
        raise MalformedBody(f"ShareFetch v{header.api_version} request does not parse: {exc}") from None
    pos += 4  # ShareSessionEpoch
    if len(frame) < pos + 4:
        raise MalformedBody(f"ShareFetch v{header.api_version} request ends before its max wait")
    return int.from_bytes(frame[pos : pos + 4], "big", signed=True)


def _throttle_offset(entry: InFlight, frame: bytes) -> int | None:
    """Where `ThrottleTimeMs` is in this response, or None where no schema says."""
    opaque = OPAQUE_APIS.get(entry.api_key)
    if opaque is None or not opaque.throttle_first or entry.api_version > opaque.max_version:
        return None
    try:
        return response_body_offset(frame, opaque.response_header_version(entry.api_version))
    except MalformedHeader as exc:
        raise MalformedHeader(f"{opaque.name} v{entry.api_version} response header: {exc}") from None


def charge_opaque_response(policy: QuotaPolicy, principal: str, entry: InFlight, frame: bytes,
                           now_ms: float) -> tuple[bytes, int, int]:
    """Charge an opaque API's response to the quotas, as `charging.charge_response` does for known ones.

    Returns the frame to send, the throttle and how long to mute from now.
    """
    request_time = max(now_ms - entry.sent_ms - entry.max_wait_ms, 0.0)
    offset = _throttle_offset(entry, frame)
    fetch_bytes = 0
    if entry.api_key == ApiKey.SHARE_FETCH and offset is not None:
        fetch_bytes = 4 + len(frame) - offset  # measured as a Fetch response is (charging.py)
    verdict = policy.charge(principal, entry.client_id or "", int(now_ms), fetch_bytes=fetch_bytes,
                            request_time_ms=request_time, api_key=entry.api_key)
    throttle = verdict.throttle_ms
    if throttle <= 0:
        return frame, 0, 0
    if offset is not None:
        if len(frame) < offset + 4:
            raise MalformedBody(f"{api_name(entry.api_key)} v{entry.api_version} response of {len(frame)} "
                                "bytes ends before its throttle_time_ms")
        broker = int.from_bytes(frame[offset : offset + 4], "big", signed=True)
        value = min(max(throttle, broker, 0), _INT32)
        frame = frame[:offset] + value.to_bytes(4, "big") + frame[offset + 4 :]
    return frame, throttle, throttle


__all__ = ["charge_opaque_response", "share_fetch_max_wait_ms"]
