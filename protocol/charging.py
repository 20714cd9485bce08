"""What a request or response costs against the quotas, and what the verdict does to its bytes.

Kept apart from the connection because it is the one place that speaks to the quota engine:
Produce is charged on arrival (bytes, new producer ids), Fetch and request time when the
response comes back (or on a streamed Fetch's first bytes), and a throttle is written into the
response the client gets (its throttle field, or a Fetch emptied of records), as a broker does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from .apis import KNOWN_APIS, ApiKey
from .controller_mutations import (
    MutationCharge,
    MutationRequest,
    PartitionCounts,
    estimate_costs,
    plan_charge,
    settle_response,
)
from .headers import RequestHeader, response_body_offset
from .in_flight import InFlight
from .skim import produce_producer_ids
from .throttling import (
    cap_fetch_bytes,
    empty_fetch_response,
    fetch_max_wait_ms,
    read_throttle,
    set_throttle,
)

#: APIs a broker never charges to the request quota: the client cannot avoid them before it is
#: authenticated (KIP-124 exempts them), and a proxy must not hold back authentication.
REQUEST_QUOTA_EXEMPT = frozenset({ApiKey.API_VERSIONS, ApiKey.SASL_HANDSHAKE, ApiKey.SASL_AUTHENTICATE})


class QuotaVerdict(Protocol):
    @property
    def throttle_ms(self) -> int: ...

    @property
    def deliver_fetch(self) -> bool: ...


class MutationVerdict(Protocol):
    @property
    def accepted(self) -> tuple[bool, ...]: ...

    @property
    def throttle_ms(self) -> int: ...


class QuotaPolicy(Protocol):
    """What the connection asks the quota engine (`quotas.engine.QuotaEngine` implements it)."""

    #: partitions a CreateTopics topic asking for the broker's default count is estimated at
    default_partitions: int

    def wants_mutation_costs(self, user: str, client_id: str) -> bool: ...

    def charge_mutations(self, user: str, client_id: str, costs: Sequence[int], strict: bool,
                         now_ms: int) -> MutationVerdict: ...

    def settle_mutations(self, user: str, client_id: str, partitions: int, now_ms: int) -> None: ...

    def note_default_partitions(self, partitions: int) -> None: ...

    def hold_ms(self, user: str, client_id: str, api_key: int, now_ms: int) -> int: ...

    def wants_producer_ids(self, user: str) -> bool: ...

    def fetch_max_bytes(self, user: str, client_id: str) -> int | None: ...

    def charge(self, user: str, client_id: str, now_ms: int, *, produce_bytes: int = 0,
               fetch_bytes: int = 0, request_time_ms: float | None = None,
               producer_ids: Sequence[int] = (), api_key: int | None = None) -> QuotaVerdict:
        """`api_key`: the request this charge counts once in the usage events; None for a later
        charge of a request already counted (a Produce's response)."""
        ...


def charge_produce(policy: QuotaPolicy, principal: str, frame: bytes, header: RequestHeader,
                   now_ms: float) -> int:
    """Charge a Produce's bytes and new producer ids as it arrives; the throttle (0 if none).

    A broker charges them when the response is ready, but it reads one request per connection
    at a time; the proxy forwards pipelined requests, so it charges on arrival to stop a
    pipelining producer as early as a broker would. The throttle goes into the response.
    """
    producer_ids: Sequence[int] = ()
    if policy.wants_producer_ids(principal):
        producer_ids = produce_producer_ids(frame, header)
    verdict = policy.charge(principal, header.client_id or "", int(now_ms),
                            produce_bytes=len(frame), producer_ids=producer_ids, api_key=ApiKey.PRODUCE)
    return verdict.throttle_ms


def prepare_fetch(policy: QuotaPolicy, principal: str, entry: InFlight, frame: bytes,
                  header: RequestHeader) -> bytes:
    """Note a Fetch's long-poll allowance and cap its size to the quota; the frame to forward."""
    entry.max_wait_ms = max(fetch_max_wait_ms(frame, header), 0)
    cap = policy.fetch_max_bytes(principal, header.client_id or "")
    if cap is not None:
        frame = cap_fetch_bytes(frame, header, cap)
    return frame


def charge_fetch(policy: QuotaPolicy, principal: str, entry: InFlight, fetch_bytes: int,
                 now_ms: float) -> QuotaVerdict:
    """Charge a streamed Fetch response on its first bytes."""
    request_time = max(now_ms - entry.sent_ms - entry.max_wait_ms, 0.0)
    return policy.charge(principal, entry.client_id or "", int(now_ms),
                         fetch_bytes=fetch_bytes, request_time_ms=request_time, api_key=ApiKey.FETCH)


def charge_mutation(policy: QuotaPolicy, principal: str, request: MutationRequest,
                    counts: PartitionCounts | None, header: RequestHeader, now_ms: float) -> MutationCharge:
    """Charge a CreateTopics / CreatePartitions / DeleteTopics on arrival, topic by topic, with
    each topic's estimate (see controller_mutations.py); its answer settles the charge."""
    costs, defaults = estimate_costs(request, counts, policy.default_partitions)
    verdict = policy.charge_mutations(principal, header.client_id or "", costs, request.strict, int(now_ms))
    return plan_charge(request, costs, defaults, verdict.accepted, verdict.throttle_ms, counts)


def settle_mutation(policy: QuotaPolicy, principal: str, entry: InFlight, frame: bytes,
                    now_ms: float) -> bytes:
    """Settle a mutation's charge with the broker's answer; the frame for the client.

    The throttle decided on arrival counts from then, as Kafka's `throttleTime` deducts the time
    since it was recorded (the connection was muted on arrival, so the mute ends when Kafka's would).
    """
    charge = entry.mutation
    assert charge is not None
    spec = KNOWN_APIS[entry.api_key]
    body_offset = response_body_offset(frame, spec.response_header_version(entry.api_version))
    settlement = settle_response(frame, body_offset, charge)
    if settlement.correction:
        policy.settle_mutations(principal, entry.client_id or "", settlement.correction, int(now_ms))
    if settlement.default_partitions is not None:
        policy.note_default_partitions(settlement.default_partitions)
    entry.throttle_ms = max(entry.throttle_ms - int(now_ms - entry.sent_ms), 0)
    return settlement.frame


def charge_response(policy: QuotaPolicy, principal: str, entry: InFlight, frame: bytes,
                    now_ms: float) -> tuple[bytes, int, int]:
    """Charge a response to the quotas.

    Returns the frame to send, the throttle it reports (including one decided when the
    request arrived) and how long to mute from now (0 when the request's mute covers it).
    """
    spec = KNOWN_APIS.get(entry.api_key)
    if spec is None:
        return frame, 0, 0
    body_offset = response_body_offset(frame, spec.response_header_version(entry.api_version))
    if entry.precharged_ms is not None:
        throttle = entry.precharged_ms
        combined = max(throttle, read_throttle(entry.api_key, entry.api_version, frame, body_offset))
        return empty_fetch_response(frame, body_offset, entry.api_version, combined), throttle, throttle
    request_time: float | None = None
    if entry.api_key not in REQUEST_QUOTA_EXEMPT:
        request_time = max(now_ms - entry.sent_ms, 0.0)
        if entry.api_key == ApiKey.FETCH:
            # A fetch may wait up to max_wait_ms for data; waiting costs a broker no thread time.
            request_time = max(request_time - entry.max_wait_ms, 0.0)
    fetch_bytes = 4 + len(frame) - body_offset if entry.api_key == ApiKey.FETCH else 0
    # a Produce was counted when it arrived (charge_produce)
    counted = None if entry.api_key == ApiKey.PRODUCE else entry.api_key
    verdict = policy.charge(principal, entry.client_id or "", int(now_ms),
                            fetch_bytes=fetch_bytes, request_time_ms=request_time, api_key=counted)
    mute = verdict.throttle_ms if verdict.throttle_ms > entry.throttle_ms else 0
    throttle = max(verdict.throttle_ms, entry.throttle_ms)
    if throttle <= 0:
        return frame, 0, 0
    combined = max(throttle, read_throttle(entry.api_key, entry.api_version, frame, body_offset))
    if entry.api_key == ApiKey.FETCH and not verdict.deliver_fetch:
        return empty_fetch_response(frame, body_offset, entry.api_version, combined), throttle, mute
    return set_throttle(entry.api_key, entry.api_version, frame, body_offset, combined), throttle, mute


__all__ = [
    "REQUEST_QUOTA_EXEMPT", "MutationVerdict", "QuotaPolicy", "QuotaVerdict", "charge_fetch",
    "charge_mutation", "charge_produce", "charge_response", "prepare_fetch", "settle_mutation",
]
