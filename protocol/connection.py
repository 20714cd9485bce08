"""One proxied connection as a sans-I/O state machine: the driver the I/O layer talks to.

The I/O layer feeds it bytes from the client and from the broker and carries out the actions it
returns (forward bytes, answer the client, close with a reason, note broker addresses). Nothing
here touches a socket or a clock, so whole exchanges are tested with byte strings.

This module keeps what ties the concerns together: framing, the order of requests and responses
(`in_flight`), muting and the requests waiting behind a mute or a quota admin answer, and
streaming large Fetch responses. Each other concern is a small module it calls, in the spirit of
Kroxylicious' one filter per concern: `actions` (what it asks of the I/O layer), `charging`
(quotas), `sasl_tracking` (who the client is), `responses` (address and ApiVersions rewrites).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Mapping
from typing import Literal

from . import controller_mutations as mutations
from .actions import (
    Action,
    Authenticated,
    AwaitSlot,
    BrokersSeen,
    Close,
    Mute,
    QuotaAdmin,
    Throttled,
    ToBroker,
    ToClient,
)
from .api_versions import check_request_version
from .apis import KNOWN_APIS, ApiKey, api_name
from .broker_admission import AdmissionGate, BrokerAdmission
from .broker_array import Address, Advertise
from .charging import (
    REQUEST_QUOTA_EXEMPT,
    QuotaPolicy,
    charge_fetch,
    charge_mutation,
    charge_produce,
    charge_response,
    prepare_fetch,
    settle_mutation,
)
from .charging import QuotaVerdict as QuotaVerdict  # re-exported: it was defined here
from .client_quotas import QUOTA_ADMIN_APIS, decode_quota_admin_request
from .client_software import FIRST_VERSION as SOFTWARE_FIRST_VERSION
from .client_software import ClientSoftware, read_client_software
from .errors import ProtocolError
from .fetch_partitions import PartitionThrottlePolicy, throttle_fetch
from .frames import DEFAULT_MAX_REQUEST_BYTES, MAX_RESPONSE_BYTES, FrameSplitter
from .headers import (
    REQUEST_API_BYTES,
    check_request_api,
    parse_request_header,
    response_body_offset,
    response_correlation_id,
)
from .in_flight import InFlight, take_local_responses
from .in_flight import size_prefix as _size
from .opaque import charge_opaque_response, share_fetch_max_wait_ms
from .passthrough import Passthrough
from .responses import rewrite_response
from .sasl import ANONYMOUS, SaslExchange
from .sasl_tracking import SASL_SETUP_APIS, SaslTracking
from .skim import produce_acks, produce_response_errors
from .throttling import cap_fetch_bytes, throttle_stream_head
from .topic_names import TopicNames, learn_metadata_topics

#: APIs whose bodies the proxy decodes; a version above its schemas is refused, not guessed.
DECODED_APIS = frozenset({
    ApiKey.METADATA, ApiKey.FIND_COORDINATOR, ApiKey.DESCRIBE_CLUSTER, ApiKey.PRODUCE, ApiKey.FETCH,
    ApiKey.SASL_HANDSHAKE, ApiKey.SASL_AUTHENTICATE, *QUOTA_ADMIN_APIS, *mutations.MUTATION_APIS,
})


#: Fetch responses at least this large go to the client as they arrive instead of being buffered
#: whole, unless over a quota (then they are emptied); a v16+ response's NodeEndpoints are
#: rewritten on the way (`fetch_stream.py`).
STREAM_MIN_BYTES = 64 * 1024
#: With quotas, a Fetch response streams once this much of it is buffered: its header and
#: throttle_time_ms, which a throttle delivered with the response is written into.
THROTTLE_HEAD_BYTES = 32


ThrottleMode = Literal["mute", "delay"]

#: Called once per answered request: (api key, request bytes, response bytes, latency ms).
ExchangeObserver = Callable[[int, int, int, float], None]

#: Called with the broker's health as each Produce and data-carrying Fetch response shows it:
#: (api key, latency ms, the Produce response's partition error codes, principal, client id): who
#: saw it matters, since one tenant alone may not move the shared capacity. Adaptive capacity only.
HealthObserver = Callable[[int, float, list[int], str, str], None]


#: A Fetch response shorter than this carried no records: it waited out its max_wait_ms, which
#: says nothing about the broker's health.
HEALTH_FETCH_MIN_BYTES = 1024


class ProxyConnection:
    """Drives one client connection and its upstream broker connection."""

    def __init__(self, advertise: Advertise, *, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 name: str = "connection", policy: QuotaPolicy | None = None,
                 throttle_mode: ThrottleMode = "mute", observer: ExchangeObserver | None = None,
                 known_brokers: Callable[[], Mapping[int, Address]] | None = None,
                 partition_throttles: PartitionThrottlePolicy | None = None,
                 topic_names: TopicNames | None = None, health: HealthObserver | None = None,
                 admission: BrokerAdmission | None = None) -> None:
        self.name = name
        self.health = health
        #: the per-broker concurrency limit's gate (broker_admission.py); None: no limit
        self._gate = AdmissionGate(admission) if admission is not None else None
        #: KIP-73 partition throttles (fetch_partitions.py) and the topic names they are
        #: configured by, learned from Metadata responses (Fetch v13+ names topics by id)
        self._partition_throttles = partition_throttles if topic_names is not None else None
        self._topic_names = topic_names
        self.observer = observer
        self._advertise = advertise
        self.policy = policy
        self.throttle_mode = throttle_mode
        self._now_ms = 0.0
        self._requests = FrameSplitter(max_request_bytes, "request")
        self._responses = FrameSplitter(MAX_RESPONSE_BYTES, "response")
        self._in_flight: deque[InFlight] = deque()
        self._sasl = SaslTracking()
        self._closed: str | None = None
        #: the Fetch response streaming to the client, while the rest of it is still to come
        self._passthrough: Passthrough | None = None
        #: the real address of every broker known (node id -> address), which bounds how much a
        #: streamed Fetch v16+ response's NodeEndpoints can grow
        self._known_brokers = known_brokers
        #: The principal name quotas see: ANONYMOUS until the broker accepts a SASL exchange.
        self.principal: str = ANONYMOUS
        self.authenticated_mechanism: str | None = None
        self.client_id: str | None = None
        #: the library and version the client named in ApiVersions v3+ (KIP-511); None until then
        self.client_software: ClientSoftware | None = None
        #: requests read but not yet acted on: they arrived while the connection was muted or
        #: behind a quota admin request being answered or a lookup (a broker reads none of them then)
        self._deferred: list[bytes] = []
        #: the quota admin request being answered, or the lookup being waited for
        self._admin_pending: InFlight | None = None
        #: what the lookup found, for the mutation request (by correlation id) at the head of `_deferred`
        self._lookup_counts: tuple[int, mutations.PartitionCounts] | None = None
        #: muted until this time (caller's clock, ms): requests wait in `_deferred`
        self._muted_until = 0.0
        #: a whole request frame has been read from the client
        self._request_seen = False
        #: the incomplete head request frame's api key and version have been checked
        self._head_checked = False

    # -- public API ---------------------------------------------------------------------------

    @property
    def closed(self) -> str | None:
        """The close reason once the connection must close, else None."""
        return self._closed

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def established(self) -> bool:
        """Whether the client has sent a whole request and is not in the middle of its SASL exchange.

        The I/O layer closes a connection not established within its setup timeout. The exchange
        ends when the broker accepts it, or (for GSSAPI, whose end the proxy cannot see) when the
        client sends a request a broker takes only after authentication succeeded.
        """
        return self._request_seen and not self._sasl.in_progress

    @property
    def request_memory_need(self) -> int:
        """Bytes this connection holds once the request frame it is reading is complete.

        The declared size (prefix included) of an incomplete head request frame whose prefix has
        arrived, else the bytes buffered, plus the requests read but waiting for a mute or an
        admin answer. 0 once closed: the I/O layer then drops everything.
        """
        if self._closed is not None:
            return 0
        declared = self._requests.declared_size
        head = self._requests.buffered if declared is None else 4 + declared
        return head + sum(len(frame) for frame in self._deferred)

    @property
    def request_bytes_held(self) -> int:
        """Bytes of requests held now: what has arrived of the frame being read, plus the
        requests waiting for a mute or an admin answer (at most `request_memory_need`)."""
        if self._closed is not None:
            return 0
        return self._requests.buffered + sum(len(frame) for frame in self._deferred)

    @property
    def sasl_in_progress(self) -> bool:
        """The connection's first SASL exchange has started and the broker has not accepted it."""
        return self._sasl.in_progress

    def receive_from_client(self, data: bytes, now_ms: float = 0.0) -> list[Action]:
        """Bytes from the client, at `now_ms` on the caller's monotonic clock."""
        if self._closed is not None:
            return []
        self._now_ms = now_ms
        try:
            frames = self._requests.feed(data)
            if frames:
                self._request_seen = True
                self._head_checked = False
            if not self._head_checked:
                self._check_head_request()
            if self._deferred:
                frames, self._deferred = self._deferred + frames, []
            if self._admin_pending is not None or self.awaiting_slot:
                self._deferred = frames
                return []
            if self._now_ms < self._muted_until:
                # Read just as the I/O layer's mute timer ended (timers may fire a little early):
                # these wait too, and the mute is re-armed for the rest.
                self._deferred = frames
                return [Mute(int(self._muted_until - self._now_ms) + 1)] if frames else []
            return self._client_frames(frames)
        except ProtocolError as exc:
            return self._close(f"client sent bad data: {exc}")

    def _check_head_request(self) -> None:
        """Refuse an incomplete request from its api key and version, before its body is buffered.

        Skipped for raw SASL tokens (SaslHandshake v0), which have no header.
        """
        if self._sasl.raw is not None or self._sasl.raw_possible:
            return
        partial = self._requests.partial()
        if partial is None or partial[1] < REQUEST_API_BYTES:
            return
        check_request_api(partial[2])
        self._head_checked = True

    @property
    def waiting_requests(self) -> bool:
        """Whether requests read from the client are waiting for a mute or an admin answer."""
        return bool(self._deferred)

    def resume(self, now_ms: float) -> list[Action]:
        """The mute has passed: act on the requests that waited (the I/O layer calls this)."""
        if self._closed is not None:
            return []
        self._now_ms = max(now_ms, self._now_ms)
        if self._admin_pending is not None or self.awaiting_slot or not self._deferred:
            return []
        if self._now_ms < self._muted_until:
            # A timer that fired a little early: wait out the rest.
            return [Mute(int(self._muted_until - self._now_ms) + 1)]
        frames, self._deferred = self._deferred, []
        try:
            return self._client_frames(frames)
        except ProtocolError as exc:
            return self._close(f"client sent bad data: {exc}")

    def slot_granted(self, ticket: Hashable, now_ms: float) -> list[Action]:
        """The request that waited (AwaitSlot) has its slot: it and the requests after it go on."""
        gate = self._gate
        if gate is None:
            return []
        if self._closed is not None:
            gate.give_back(ticket)
            return []
        if not gate.granted(ticket):
            return []  # nobody waits for it: the gate gave it back
        return self.resume(now_ms)

    def release_slots(self) -> list[Hashable]:
        """The client left: the slots its requests hold, for the I/O layer to give back. Admission
        ends for this connection, so what it sent before leaving goes on without waiting (as a
        broker reads what a closed connection sent), rather than wait for a slot nobody tracks."""
        entries = list(self._in_flight)
        if self._passthrough is not None:  # a Fetch streaming to the client holds its slot too
            entries.append(self._passthrough.entry)
        held = [entry.slot for entry in entries if entry.slot is not None]
        for entry in entries:
            entry.slot = None
        if self._gate is not None:
            held += self._gate.release()
            self._gate = None
        return held

    @property
    def awaiting_slot(self) -> bool:
        return self._gate is not None and self._gate.awaiting

    def _mute(self, ms: int, actions: list[Action]) -> None:
        """Stop reading for `ms`; requests already read wait too, as in a muted broker socket."""
        self._muted_until = max(self._muted_until, self._now_ms + ms)
        actions.append(Mute(ms))

    def answer_quota_admin(self, response: bytes, now_ms: float = 0.0) -> list[Action]:
        """The answer to the pending `QuotaAdmin` request (header and body, no size prefix).

        It goes out in its turn; the requests that waited behind it are then processed.
        """
        entry = self._admin_pending
        if self._closed is not None or entry is None:
            return []
        self._now_ms = now_ms
        self._admin_pending = None
        entry.local_response = response
        entry.awaiting_answer = False
        actions: list[Action] = []
        if self._passthrough is None:
            local = take_local_responses(self._in_flight)
            if local:
                actions.append(ToClient(local))
        if self.observer is not None:
            self.observer(entry.api_key, entry.request_bytes, len(response), now_ms - entry.sent_ms)
        if self._now_ms < self._muted_until:
            return actions  # the mute's end resumes the waiting requests
        return actions + self.resume(now_ms)

    def receive_from_broker(self, data: bytes, now_ms: float = 0.0) -> list[Action]:
        """Bytes from the broker, at `now_ms` on the caller's monotonic clock."""
        if self._closed is not None:
            return []
        self._now_ms = now_ms
        try:
            actions: list[Action] = []
            stream = self._passthrough
            if stream is not None:
                data = stream.feed(data, actions)
                if not stream.remaining:
                    self._end_stream(stream, actions)
                if not data:
                    return actions
            actions += self._broker_frames(self._responses.feed(data))
            self._maybe_stream(actions)
            return actions
        except ProtocolError as exc:
            return self._close(f"broker sent bad data: {exc}")

    def _maybe_stream(self, actions: list[Action]) -> None:
        """Start passing a large Fetch response through before it is complete, when allowed."""
        if self._sasl.raw is not None or not self._in_flight:
            return
        entry = self._in_flight[0]
        if entry.api_key != ApiKey.FETCH or entry.precharged_ms is not None:
            return
        throttles = self._partition_throttles
        if throttles is not None and throttles.applies_to(self.principal, entry.client_id or ""):
            return  # buffered whole: some partitions' records may be emptied
        partial = self._responses.partial()
        if partial is None:
            return
        size, buffered, first = partial
        if size < STREAM_MIN_BYTES or buffered < 4:
            return
        correlation_id = response_correlation_id(first)
        if correlation_id != entry.correlation_id:
            raise ProtocolError(
                f"response correlation id {correlation_id} does not match the oldest request "
                f"(Fetch, correlation id {entry.correlation_id})")
        throttle = 0
        if self.policy is not None:
            if buffered < THROTTLE_HEAD_BYTES:
                return  # a throttle must be written into the first bytes sent
            # Charged on its first bytes: its size is in the prefix, and time to first byte is
            # the better measure of what it cost the broker.
            verdict = charge_fetch(self.policy, self.principal, entry, 4 + size - 5, self._now_ms)
            throttle = verdict.throttle_ms
            if throttle > 0 and not verdict.deliver_fetch:
                entry.precharged_ms = throttle  # over quota: buffer it whole and empty it
                return
        self._in_flight.popleft()
        head = self._responses.take_partial()
        if throttle > 0:  # delivered all the same (the smooth shape): its throttle goes in, then a mute
            head = throttle_stream_head(entry.api_version, head, throttle)
            actions.append(Throttled(ApiKey.FETCH, throttle))
            self._mute(throttle, actions)
        brokers = self._known_brokers() if self._known_brokers is not None else None
        self._passthrough = Passthrough(entry, size, head, self._advertise, brokers, actions)

    def _note_health(self, entry: InFlight, frame: bytes) -> None:
        """Tell the health observer what this response says of its broker (see HealthObserver)."""
        assert self.health is not None
        latency = self._now_ms - entry.sent_ms
        if entry.api_key == ApiKey.FETCH:
            if len(frame) >= HEALTH_FETCH_MIN_BYTES:
                self.health(ApiKey.FETCH, latency, [], self.principal, entry.client_id or "")
            return
        spec = KNOWN_APIS[ApiKey.PRODUCE]
        try:
            offset = response_body_offset(frame, spec.response_header_version(entry.api_version))
            errors = produce_response_errors(frame, offset, entry.api_version)
        except ProtocolError:
            errors = []  # the response goes on as it is; its time still tells
        self.health(ApiKey.PRODUCE, latency, errors, self.principal, entry.client_id or "")

    def _admission_answered(self, entry: InFlight, size: int) -> None:
        """A response of `size` bytes ended `entry` (whole, or streamed to its last byte): the gate
        learns whether a Fetch's consumer is catching up, and the request's slot goes back. Only a
        Produce's time judges the limit: a Fetch's includes its long poll."""
        gate = self._gate
        if gate is None:
            return
        if entry.api_key == ApiKey.FETCH:
            gate.fetch_answered(size)
        if entry.slot is not None:
            slot, entry.slot = entry.slot, None
            gate.answered(slot, self._now_ms - entry.sent_ms if entry.api_key == ApiKey.PRODUCE else None)

    def _end_stream(self, stream: Passthrough, actions: list[Action]) -> None:
        self._passthrough = None
        entry = stream.entry
        self._admission_answered(entry, stream.announced_size)
        if self.observer is not None:
            self.observer(entry.api_key, entry.request_bytes, stream.announced_size,
                          self._now_ms - entry.sent_ms)
        local = take_local_responses(self._in_flight)
        if local:
            actions.append(ToClient(local))

    # -- client -> broker ---------------------------------------------------------------------

    def _close(self, reason: str) -> list[Action]:
        self._closed = reason
        return [Close(reason)]

    def _client_frames(self, frames: list[bytes]) -> list[Action]:
        upstream: list[bytes] = []
        actions: list[Action] = []
        sasl = self._sasl
        for index, frame in enumerate(frames):
            if sasl.raw is not None:
                sasl.raw.client_token(frame)
                upstream += (_size(len(frame)), frame)
                continue
            if self._now_ms < self._muted_until:
                # Muted by the request before this one: the rest wait, unread as far as the
                # quotas are concerned, just as a broker reads nothing from a muted connection.
                self._deferred = frames[index:]
                break
            header = parse_request_header(frame)
            if header.client_id is not None:
                self.client_id = header.client_id
            if sasl.in_progress and header.api_key not in SASL_SETUP_APIS:
                sasl.settle()
            entry = InFlight(header.correlation_id, header.api_key, header.api_version, header.client_id)
            entry.local_response = check_request_version(header, DECODED_APIS)
            if entry.local_response is not None:  # an ApiVersions newer than the proxy's schemas
                self._queue_local(entry, actions)
                continue
            expects_response = True
            entry.sent_ms = self._now_ms
            entry.request_bytes = len(frame)
            if header.api_key in QUOTA_ADMIN_APIS:
                # Answered by the proxy, not charged to quotas (no broker does the work).
                request = decode_quota_admin_request(frame, header)
                if upstream:
                    actions.append(ToBroker(upstream))
                entry.awaiting_answer = True
                self._in_flight.append(entry)
                self._admin_pending = entry
                self._deferred = frames[index + 1:]
                actions.append(QuotaAdmin(header.correlation_id, header.api_key, header.api_version,
                                          request, self.principal))
                return actions
            if self.policy is not None and header.api_key not in REQUEST_QUOTA_EXEMPT:
                # ShareFetch waits on the fetch bucket as Fetch does: Kafka charges it to the fetch quota.
                bucket_key = ApiKey.FETCH if header.api_key == ApiKey.SHARE_FETCH else header.api_key
                hold = self.policy.hold_ms(self.principal, header.client_id or "", bucket_key,
                                           int(self._now_ms))
                if hold > 0:
                    # The bucket is throttled (maybe on another connection): this request and
                    # those after it wait, and are charged only when they go on.
                    self._deferred = frames[index:]
                    self._mute(hold, actions)
                    break
            if (header.api_key in mutations.MUTATION_APIS and self.policy is not None
                    and self.policy.wants_mutation_costs(self.principal, header.client_id or "")):
                mutation = mutations.decode_mutation(frame, header)
                counts, self._lookup_counts = self._lookup_counts, None
                if mutation.needs_lookup and (counts is None or counts[0] != header.correlation_id):
                    # Its costs need partition counts: ask first; it and the requests after it wait.
                    self._admin_pending, lookup = mutations.lookup(mutation, header)
                    self._in_flight.append(self._admin_pending)
                    actions.append(ToBroker([*upstream, _size(len(lookup)), lookup]))
                    self._deferred = frames[index:]
                    return actions
                charge = charge_mutation(self.policy, self.principal, mutation, counts and counts[1], header,
                                         self._now_ms)
                if charge.throttle_ms > 0:  # muted from now: it ends when Kafka's would
                    entry.throttle_ms = charge.throttle_ms
                    actions.append(Throttled(header.api_key, charge.throttle_ms))
                    self._mute(charge.throttle_ms, actions)
                frame, entry.local_response = mutations.route(frame, header, charge)
                if entry.local_response is not None:
                    self._queue_local(entry, actions)  # every topic refused: the proxy answers
                    continue
                entry.mutation = charge
            elif header.api_key == ApiKey.PRODUCE:
                expects_response = produce_acks(frame, header) != 0
                if expects_response and self._gate is not None:
                    ticket = self._gate.take(self.principal, header.client_id or "")
                    if ticket is None:  # its broker has its limit in flight: this and the rest wait
                        self._deferred = frames[index:]
                        actions.append(AwaitSlot())
                        break
                    entry.slot = ticket
                if self.policy is not None:
                    throttle = charge_produce(self.policy, self.principal, frame, header, self._now_ms)
                    if throttle > 0:
                        # Charged on arrival (see charge_produce): mute at once, report it later.
                        entry.throttle_ms = throttle
                        actions.append(Throttled(ApiKey.PRODUCE, throttle))
                        self._mute(throttle, actions)
            elif header.api_key == ApiKey.FETCH:
                gate = self._gate
                if gate is not None and gate.catching_up:  # it will make the broker work
                    ticket = gate.take(self.principal, header.client_id or "")
                    if ticket is None:  # its broker has its limit in flight: this and the rest wait
                        self._deferred = frames[index:]
                        actions.append(AwaitSlot())
                        break
                    entry.slot = ticket
                    cap = gate.fetch_max_bytes(self.principal, header.client_id or "")
                    if cap is not None:
                        frame = cap_fetch_bytes(frame, header, cap)
                if self.policy is not None:
                    frame = prepare_fetch(self.policy, self.principal, entry, frame, header)
            elif header.api_key == ApiKey.SHARE_FETCH and self.policy is not None:
                entry.max_wait_ms = max(share_fetch_max_wait_ms(frame, header), 0)  # a long poll, as Fetch's
            elif header.api_key == ApiKey.SASL_HANDSHAKE:
                sasl.handshake_request(frame, header)
            elif header.api_key == ApiKey.SASL_AUTHENTICATE:
                sasl.authenticate_request(frame, header)
            elif header.api_key == ApiKey.API_VERSIONS and header.api_version >= SOFTWARE_FIRST_VERSION:
                self.client_software = read_client_software(frame, header) or self.client_software
            if expects_response:
                self._in_flight.append(entry)
            upstream += (_size(len(frame)), frame)
        if upstream:
            actions.append(ToBroker(upstream))
        return actions

    def _queue_local(self, entry: InFlight, actions: list[Action]) -> None:
        if self._in_flight or self._passthrough is not None:  # behind requests, or a response mid-stream
            self._in_flight.append(entry)
        else:
            assert entry.local_response is not None
            actions.append(ToClient([_size(len(entry.local_response)), entry.local_response]))

    # -- broker -> client ---------------------------------------------------------------------

    def _broker_frames(self, frames: list[bytes]) -> list[Action]:
        downstream: list[bytes] = []
        actions: list[Action] = []
        sasl = self._sasl
        looked_up = False
        for frame in frames:
            if sasl.raw is not None:
                accepted = sasl.raw_server_token(frame)
                if accepted is not None:
                    actions.append(self._authenticated(accepted))
                downstream += (_size(len(frame)), frame)
                continue
            correlation_id = response_correlation_id(frame)
            if not self._in_flight:
                raise ProtocolError(f"response with correlation id {correlation_id} but no request in flight")
            entry = self._in_flight.popleft()
            if entry.correlation_id != correlation_id:
                raise ProtocolError(
                    f"response correlation id {correlation_id} does not match the oldest request "
                    f"({api_name(entry.api_key)}, correlation id {entry.correlation_id})"
                )
            if entry.lookup_for is not None:
                self._lookup_counts = entry.lookup_for, mutations.lookup_counts(frame, entry.api_version)
                self._admin_pending = None
                looked_up = True
                continue
            key = entry.api_key
            if entry.mutation is not None and self.policy is not None:
                frame = settle_mutation(self.policy, self.principal, entry, frame, self._now_ms)
            if key == ApiKey.SASL_HANDSHAKE:
                sasl.handshake_response(frame, entry.api_version)
            elif key == ApiKey.SASL_AUTHENTICATE:
                accepted = sasl.authenticate_response(frame, entry.api_version)
                if accepted is not None:
                    actions.append(self._authenticated(accepted))
            else:
                frame = rewrite_response(entry, frame, self._advertise, actions)
            if self.health is not None and key in (ApiKey.PRODUCE, ApiKey.FETCH):
                self._note_health(entry, frame)
            self._admission_answered(entry, len(frame))
            hold_ms = 0
            if self._partition_throttles is not None and key in (ApiKey.FETCH, ApiKey.METADATA):
                frame, hold_ms = self._throttle_partitions(entry, frame)
            throttle_ms = mute_ms = 0
            if self.policy is not None:
                charge = charge_response if entry.api_key in KNOWN_APIS else charge_opaque_response
                frame, throttle_ms, mute_ms = charge(self.policy, self.principal, entry, frame, self._now_ms)
            if self.observer is not None:  # what the client gets: a throttled Fetch goes out empty
                self.observer(entry.api_key, entry.request_bytes, len(frame), self._now_ms - entry.sent_ms)
            if throttle_ms > 0:
                if mute_ms > 0:
                    actions.append(Throttled(entry.api_key, mute_ms))
                # The proxy's own responses queued behind this one go with it, in order.
                held = [_size(len(frame)), frame, *take_local_responses(self._in_flight)]
                if self.throttle_mode == "delay":
                    # Hold this response (and, to keep order, all after it) for the throttle.
                    if downstream:
                        actions.append(ToClient(downstream))
                        downstream = []
                    actions.append(ToClient(held, delay_ms=throttle_ms))
                else:
                    actions.append(ToClient(downstream + held))
                    downstream = []
                if mute_ms > 0:
                    self._mute(mute_ms, actions)
                continue
            if hold_ms > 0:  # left without records by the partition throttles: held as a long poll
                if downstream:
                    actions.append(ToClient(downstream))
                    downstream = []
                actions.append(ToClient([_size(len(frame)), frame, *take_local_responses(self._in_flight)],
                                        delay_ms=hold_ms))
                continue
            downstream += (_size(len(frame)), frame)
            downstream += take_local_responses(self._in_flight)
        if downstream:
            actions.append(ToClient(downstream))
        if looked_up:  # the mutation request that waited for its partition counts goes on
            actions += self.resume(self._now_ms)
        return actions

    def _throttle_partitions(self, entry: InFlight, frame: bytes) -> tuple[bytes, int]:
        """A Fetch response under the KIP-73 partition throttles (charged to the quotas as sent),
        and how long to hold it when nothing is left in it, within its own max_wait_ms; from a
        Metadata response, the ids of the throttled topics."""
        throttles, names = self._partition_throttles, self._topic_names
        assert throttles is not None and names is not None
        if entry.api_key == ApiKey.METADATA:
            learn_metadata_topics(names, frame, entry.api_version, throttles.topics)
            return frame, 0
        fetched = throttle_fetch(throttles, names, self.principal, entry.client_id or "", frame,
                                 entry.api_version, int(self._now_ms))
        left = entry.max_wait_ms - (self._now_ms - entry.sent_ms)
        return fetched.frame, int(min(fetched.hold_ms, max(left, 0)))

    def _authenticated(self, exchange: SaslExchange) -> Authenticated:
        """The broker accepted the exchange: only now does the claimed name count."""
        self.authenticated_mechanism = exchange.mechanism
        self._sasl.settle()
        if exchange.candidate is not None:
            self.principal = exchange.candidate
        return Authenticated(self.principal, exchange.mechanism)


__all__ = [
    "Action",
    "Authenticated",
    "AwaitSlot",
    "BrokerAdmission",
    "BrokersSeen",
    "Close",
    "InFlight",
    "Mute",
    "ProxyConnection",
    "QuotaAdmin",
    "QuotaPolicy",
    "Throttled",
    "ToBroker",
    "ToClient",
]
