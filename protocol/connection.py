"""One proxied connection as a sans-I/O state machine.

The I/O layer feeds it bytes from the client and from the broker and carries out the actions it
returns (forward bytes, answer the client, close with a reason, note broker addresses). Nothing
here touches a socket or a clock, so whole exchanges are tested with byte strings.

Ordering: a Kafka connection answers requests in the order they were sent. Responses the proxy
makes itself (an ApiVersions refusal) wait in the same queue as forwarded requests, so they
reach the client in order; Produce with acks=0 gets no response and takes no place in the queue.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from kafka.protocol.sasl import SaslAuthenticateRequest, SaslAuthenticateResponse, SaslHandshakeRequest

from .addresses import Address, Advertise, needs_rewrite, rewrite_addresses
from .api_versions import UNSUPPORTED_VERSION, clamp_api_versions, unsupported_version_response
from .apis import KNOWN_APIS, ApiKey, api_name
from .client_quotas import QUOTA_ADMIN_APIS, QuotaAdminRequest, decode_quota_admin_request
from .errors import MalformedBody, ProtocolError, UnsupportedVersion
from .frames import DEFAULT_MAX_REQUEST_BYTES, MAX_RESPONSE_BYTES, FrameSplitter
from .headers import (
    REQUEST_API_BYTES,
    RequestHeader,
    check_request_api,
    parse_request_header,
    response_body_offset,
    response_correlation_id,
)
from .sasl import ANONYMOUS, RAW_SASL_MECHANISMS, SaslExchange
from .skim import decode_strict, produce_acks, produce_producer_ids
from .throttling import (
    cap_fetch_bytes,
    empty_fetch_response,
    fetch_max_wait_ms,
    read_throttle,
    set_throttle,
)

#: APIs whose bodies the proxy decodes; a version above its schemas is refused, not guessed.
DECODED_APIS = frozenset({
    ApiKey.METADATA, ApiKey.FIND_COORDINATOR, ApiKey.DESCRIBE_CLUSTER, ApiKey.PRODUCE, ApiKey.FETCH,
    ApiKey.SASL_HANDSHAKE, ApiKey.SASL_AUTHENTICATE, *QUOTA_ADMIN_APIS,
})


#: Fetch responses at least this large go to the client as they arrive instead of being buffered
#: whole, when nothing in them must change (no address to rewrite, not over a quota).
STREAM_MIN_BYTES = 64 * 1024

#: APIs a broker never charges to the request quota: the client cannot avoid them before it is
#: authenticated (KIP-124 exempts them), and a proxy must not hold back authentication.
REQUEST_QUOTA_EXEMPT = frozenset({ApiKey.API_VERSIONS, ApiKey.SASL_HANDSHAKE, ApiKey.SASL_AUTHENTICATE})

#: The only requests a broker takes while a SASL exchange is in progress (Kafka's
#: SaslServerAuthenticator closes the connection on any other): another request means the client
#: saw the exchange succeed.
SASL_SETUP_APIS = REQUEST_QUOTA_EXEMPT


class QuotaVerdict(Protocol):
    @property
    def throttle_ms(self) -> int: ...


class QuotaPolicy(Protocol):
    """What the connection asks the quota engine (`quotas.engine.QuotaEngine` implements it)."""

    def hold_ms(self, user: str, client_id: str, api_key: int, now_ms: int) -> int: ...

    def wants_producer_ids(self, user: str) -> bool: ...

    def fetch_max_bytes(self, user: str, client_id: str) -> int | None: ...

    def charge(self, user: str, client_id: str, now_ms: int, *, produce_bytes: int = 0,
               fetch_bytes: int = 0, request_time_ms: float | None = None,
               producer_ids: Sequence[int] = ()) -> QuotaVerdict: ...


ThrottleMode = Literal["mute", "delay"]

#: Called once per answered request: (api key, request bytes, response bytes, latency ms).
ExchangeObserver = Callable[[int, int, int, float], None]


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


Action = ToBroker | ToClient | Close | BrokersSeen | Authenticated | Mute | Throttled | QuotaAdmin


@dataclass(slots=True)
class InFlight:
    """A request awaiting its response, or a response the proxy made, waiting for its turn."""

    correlation_id: int
    api_key: int
    api_version: int
    client_id: str | None
    local_response: bytes | None = None
    #: when the request went upstream (the caller's clock, ms)
    sent_ms: float = 0.0
    #: a Fetch's long-poll allowance, not charged as request time
    max_wait_ms: int = 0
    request_bytes: int = 0
    #: throttle already decided when the request arrived (Produce bytes, producer ids)
    throttle_ms: int = 0
    #: a Fetch response already charged when its first bytes arrived (it was over quota, so it
    #: is buffered to be emptied instead of streamed): its throttle
    precharged_ms: int | None = None
    #: a quota admin request the I/O layer is still answering
    awaiting_answer: bool = False


def _size(n: int) -> bytes:
    return n.to_bytes(4, "big")


class ProxyConnection:
    """Drives one client connection and its upstream broker connection."""

    def __init__(self, advertise: Advertise, *, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 name: str = "connection", policy: QuotaPolicy | None = None,
                 throttle_mode: ThrottleMode = "mute", observer: ExchangeObserver | None = None) -> None:
        self.name = name
        self.observer = observer
        self._advertise = advertise
        self.policy = policy
        self.throttle_mode = throttle_mode
        self._now_ms = 0.0
        self._requests = FrameSplitter(max_request_bytes, "request")
        self._responses = FrameSplitter(MAX_RESPONSE_BYTES, "response")
        self._in_flight: deque[InFlight] = deque()
        self._sasl: SaslExchange | None = None
        #: SaslHandshake v0: tokens travel as bare frames until this exchange completes
        self._raw_sasl: SaslExchange | None = None
        self._closed: str | None = None
        #: bytes of the response being streamed that are still to come, and its request
        self._passthrough = 0
        self._streaming: InFlight | None = None
        self._streaming_size = 0
        #: The principal name quotas see: ANONYMOUS until the broker accepts a SASL exchange.
        self.principal: str = ANONYMOUS
        self.authenticated_mechanism: str | None = None
        self.client_id: str | None = None
        #: requests read but not yet acted on: they arrived while the connection was muted or
        #: behind a quota admin request still being answered (a broker reads none of them then)
        self._deferred: list[bytes] = []
        self._admin_pending: InFlight | None = None
        #: muted until this time (caller's clock, ms): requests wait in `_deferred`
        self._muted_until = 0.0
        #: a whole request frame has been read from the client
        self._request_seen = False
        #: the connection's first SASL exchange has started and not yet been accepted; and
        #: whether one ever was (a re-authentication, KIP-368, does not undo `established`)
        self._sasl_in_progress = False
        self._sasl_settled = False
        #: a SaslHandshake v0 awaits its answer: the client's next frame may be a raw token
        self._raw_sasl_possible = False
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
        return self._request_seen and not self._sasl_in_progress

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
        return self._sasl_in_progress

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
            if self._admin_pending is not None:
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
        if self._raw_sasl is not None or self._raw_sasl_possible:
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
        if self._admin_pending is not None or not self._deferred:
            return []
        if self._now_ms < self._muted_until:
            # A timer that fired a little early: wait out the rest.
            return [Mute(int(self._muted_until - self._now_ms) + 1)]
        frames, self._deferred = self._deferred, []
        try:
            return self._client_frames(frames)
        except ProtocolError as exc:
            return self._close(f"client sent bad data: {exc}")

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
        if not self._passthrough:
            local = self._take_local_responses()
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
            if self._passthrough:
                take = min(self._passthrough, len(data))
                actions.append(ToClient([data[:take]]))
                self._passthrough -= take
                data = data[take:]
                if not self._passthrough:
                    self._end_stream(actions)
                if not data:
                    return actions
            actions += self._broker_frames(self._responses.feed(data))
            self._maybe_stream(actions)
            return actions
        except ProtocolError as exc:
            return self._close(f"broker sent bad data: {exc}")

    def _maybe_stream(self, actions: list[Action]) -> None:
        """Start passing a large Fetch response through before it is complete, when allowed."""
        if self._raw_sasl is not None or not self._in_flight:
            return
        entry = self._in_flight[0]
        if (entry.api_key != ApiKey.FETCH or entry.precharged_ms is not None
                or needs_rewrite(ApiKey.FETCH, entry.api_version)):
            return
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
        if self.policy is not None:
            # Charged on its first bytes: its size is in the prefix, and time to first byte is
            # the better measure of what it cost the broker.
            throttle = self._charge_fetch(entry, 4 + size - 5)
            if throttle > 0:
                entry.precharged_ms = throttle  # over quota: buffer it whole and empty it
                return
        self._in_flight.popleft()
        head = self._responses.take_partial()
        self._streaming = entry
        self._passthrough = size - len(head)
        self._streaming_size = size
        actions.append(ToClient([_size(size), head]))

    def _end_stream(self, actions: list[Action]) -> None:
        entry = self._streaming
        self._streaming = None
        if entry is not None and self.observer is not None:
            self.observer(entry.api_key, entry.request_bytes, self._streaming_size,
                          self._now_ms - entry.sent_ms)
        local = self._take_local_responses()
        if local:
            actions.append(ToClient(local))

    def _take_local_responses(self) -> list[bytes]:
        """The proxy's own responses now at the head of the queue, framed, in order."""
        local: list[bytes] = []
        while self._in_flight and self._in_flight[0].local_response is not None:
            response = self._in_flight.popleft().local_response
            assert response is not None
            local += (_size(len(response)), response)
        return local

    def _charge_fetch(self, entry: InFlight, fetch_bytes: int) -> int:
        assert self.policy is not None
        request_time = max(self._now_ms - entry.sent_ms - entry.max_wait_ms, 0.0)
        verdict = self.policy.charge(self.principal, entry.client_id or "", int(self._now_ms),
                                     fetch_bytes=fetch_bytes, request_time_ms=request_time)
        return verdict.throttle_ms

    # -- client -> broker ---------------------------------------------------------------------

    def _close(self, reason: str) -> list[Action]:
        self._closed = reason
        return [Close(reason)]

    def _client_frames(self, frames: list[bytes]) -> list[Action]:
        upstream: list[bytes] = []
        actions: list[Action] = []
        for index, frame in enumerate(frames):
            if self._raw_sasl is not None:
                self._raw_sasl.client_token(frame)
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
            if self._sasl_in_progress and header.api_key not in SASL_SETUP_APIS:
                self._sasl_settled, self._sasl_in_progress = True, False
            spec = KNOWN_APIS.get(header.api_key)
            entry = InFlight(header.correlation_id, header.api_key, header.api_version, header.client_id)
            if spec is not None and header.api_version > spec.max_version:
                if header.api_key == ApiKey.API_VERSIONS:
                    entry.local_response = unsupported_version_response(header.correlation_id)
                    self._queue_local(entry, actions)
                    continue
                if header.api_key in DECODED_APIS:
                    raise UnsupportedVersion(
                        f"{spec.name} v{header.api_version} is above v{spec.max_version}, the newest "
                        "the proxy can decode (the client ignored the ApiVersions answer)"
                    )
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
                hold = self.policy.hold_ms(self.principal, header.client_id or "", header.api_key,
                                           int(self._now_ms))
                if hold > 0:
                    # The bucket is throttled (maybe on another connection): this request and
                    # those after it wait, and are charged only when they go on.
                    self._deferred = frames[index:]
                    self._mute(hold, actions)
                    break
            if header.api_key == ApiKey.PRODUCE:
                expects_response = produce_acks(frame, header) != 0
                if self.policy is not None:
                    self._produce_request(entry, frame, header, actions)
            elif header.api_key == ApiKey.FETCH and self.policy is not None:
                entry.max_wait_ms = max(fetch_max_wait_ms(frame, header), 0)
                cap = self.policy.fetch_max_bytes(self.principal, header.client_id or "")
                if cap is not None:
                    frame = cap_fetch_bytes(frame, header, cap)
            elif header.api_key == ApiKey.SASL_HANDSHAKE:
                self._sasl = SaslExchange(self._decode_request(frame, header).mechanism)
                self._sasl_in_progress = not self._sasl_settled
                self._raw_sasl_possible = header.api_version == 0
            elif header.api_key == ApiKey.SASL_AUTHENTICATE:
                if self._sasl is None:
                    raise MalformedBody("SaslAuthenticate without a SaslHandshake first")
                self._sasl.client_token(bytes(self._decode_request(frame, header).auth_bytes))
            if expects_response:
                self._in_flight.append(entry)
            upstream += (_size(len(frame)), frame)
        if upstream:
            actions.append(ToBroker(upstream))
        return actions

    def _produce_request(self, entry: InFlight, frame: bytes, header: RequestHeader,
                         actions: list[Action]) -> None:
        """Charge a Produce's bytes and new producer ids as it arrives, and mute at once if over.

        A broker charges them when the response is ready, but it reads one request per connection
        at a time; the proxy forwards pipelined requests, so it charges on arrival to stop a
        pipelining producer as early as a broker would. The throttle goes into the response.
        """
        assert self.policy is not None
        producer_ids: Sequence[int] = ()
        if self.policy.wants_producer_ids(self.principal):
            producer_ids = produce_producer_ids(frame, header)
        verdict = self.policy.charge(self.principal, header.client_id or "", int(self._now_ms),
                                     produce_bytes=len(frame), producer_ids=producer_ids)
        if verdict.throttle_ms > 0:
            entry.throttle_ms = verdict.throttle_ms
            actions.append(Throttled(ApiKey.PRODUCE, verdict.throttle_ms))
            self._mute(verdict.throttle_ms, actions)

    def _decode_request(self, frame: bytes, header: RequestHeader) -> Any:
        cls = {ApiKey.SASL_HANDSHAKE: SaslHandshakeRequest,
               ApiKey.SASL_AUTHENTICATE: SaslAuthenticateRequest}[ApiKey(header.api_key)]
        # Strict: a null mechanism or token (length -1) is refused as a broker refuses it.
        return decode_strict(cls, frame, header.body_offset, header.api_version,
                             f"{api_name(header.api_key)} v{header.api_version} request")

    def _queue_local(self, entry: InFlight, actions: list[Action]) -> None:
        if self._in_flight or self._passthrough:  # behind requests, or behind a response mid-stream
            self._in_flight.append(entry)
        else:
            assert entry.local_response is not None
            actions.append(ToClient([_size(len(entry.local_response)), entry.local_response]))

    # -- broker -> client ---------------------------------------------------------------------

    def _broker_frames(self, frames: list[bytes]) -> list[Action]:
        downstream: list[bytes] = []
        actions: list[Action] = []
        for frame in frames:
            if self._raw_sasl is not None:
                if self._raw_sasl.server_token(frame):
                    actions.append(self._authenticated(self._raw_sasl))
                    self._raw_sasl = None
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
            frame = self._on_response(entry, frame, actions)
            throttle_ms = mute_ms = 0
            if self.policy is not None:
                frame, throttle_ms, mute_ms = self._charge_response(entry, frame)
            if self.observer is not None:  # what the client gets: a throttled Fetch goes out empty
                self.observer(entry.api_key, entry.request_bytes, len(frame), self._now_ms - entry.sent_ms)
            if throttle_ms > 0:
                if mute_ms > 0:
                    actions.append(Throttled(entry.api_key, mute_ms))
                # The proxy's own responses queued behind this one go with it, in order.
                held = [_size(len(frame)), frame, *self._take_local_responses()]
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
            downstream += (_size(len(frame)), frame)
            downstream += self._take_local_responses()
        if downstream:
            actions.append(ToClient(downstream))
        return actions

    def _charge_response(self, entry: InFlight, frame: bytes) -> tuple[bytes, int, int]:
        """Charge a response to the quotas.

        Returns the frame to send, the throttle it reports (including one decided when the
        request arrived) and how long to mute from now (0 when the request's mute covers it).
        """
        assert self.policy is not None
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
            request_time = max(self._now_ms - entry.sent_ms, 0.0)
            if entry.api_key == ApiKey.FETCH:
                # A fetch may wait up to max_wait_ms for data; waiting costs a broker no thread time.
                request_time = max(request_time - entry.max_wait_ms, 0.0)
        fetch_bytes = 4 + len(frame) - body_offset if entry.api_key == ApiKey.FETCH else 0
        verdict = self.policy.charge(self.principal, entry.client_id or "", int(self._now_ms),
                                     fetch_bytes=fetch_bytes, request_time_ms=request_time)
        mute = verdict.throttle_ms if verdict.throttle_ms > entry.throttle_ms else 0
        throttle = max(verdict.throttle_ms, entry.throttle_ms)
        if throttle <= 0:
            return frame, 0, 0
        combined = max(throttle, read_throttle(entry.api_key, entry.api_version, frame, body_offset))
        if entry.api_key == ApiKey.FETCH:
            return empty_fetch_response(frame, body_offset, entry.api_version, combined), throttle, mute
        return set_throttle(entry.api_key, entry.api_version, frame, body_offset, combined), throttle, mute

    def _on_response(self, entry: InFlight, frame: bytes, actions: list[Action]) -> bytes:
        spec = KNOWN_APIS.get(entry.api_key)
        if spec is None:
            return frame
        key, version = entry.api_key, entry.api_version
        header_version = spec.response_header_version(version)
        if needs_rewrite(key, version):
            result = rewrite_addresses(key, version, frame, header_version, self._advertise)
            if result.discovered:
                actions.append(BrokersSeen(result.discovered))
            return result.frame
        if key == ApiKey.API_VERSIONS:
            start = response_body_offset(frame, 0)
            error_code = int.from_bytes(frame[start : start + 2], "big", signed=True)
            if error_code == UNSUPPORTED_VERSION:
                # The broker refuses the client's version with a v0 body and its range (KIP-511).
                body, _ = clamp_api_versions(frame[start:], 0)
                return frame[:start] + body
            if error_code != 0:
                return frame  # any other error is in the request's version, with no ranges to clamp
            body, _ = clamp_api_versions(frame[start:], version)
            return frame[:start] + body
        if key == ApiKey.SASL_HANDSHAKE:
            self._raw_sasl_possible = False
            start = response_body_offset(frame, header_version)
            error_code = int.from_bytes(frame[start : start + 2], "big", signed=True)
            if error_code == 0 and version == 0 and self._sasl is not None:
                if self._sasl.mechanism not in RAW_SASL_MECHANISMS:
                    # Raw tokens have no framing of their own: without knowing where the exchange
                    # ends, the proxy could no longer tell tokens from Kafka requests.
                    raise UnsupportedVersion(
                        f"SaslHandshake v0 with mechanism {self._sasl.mechanism}: the proxy cannot tell "
                        "where its raw tokens end (clients since Kafka 1.0 use v1, which works)")
                self._raw_sasl = self._sasl
        elif key == ApiKey.SASL_AUTHENTICATE and self._sasl is not None:
            start = response_body_offset(frame, header_version)
            answer = decode_strict(SaslAuthenticateResponse, frame, start, version,
                                   f"SaslAuthenticate v{version} response")
            if answer.error_code != 0:
                self._sasl = None  # the broker closes the connection after a failed exchange
            elif self._sasl.server_token(bytes(answer.auth_bytes)):
                actions.append(self._authenticated(self._sasl))
        return frame

    def _authenticated(self, exchange: SaslExchange) -> Authenticated:
        """The broker accepted the exchange: only now does the claimed name count."""
        self.authenticated_mechanism = exchange.mechanism
        self._sasl_settled, self._sasl_in_progress = True, False
        if exchange.candidate is not None:
            self.principal = exchange.candidate
        return Authenticated(self.principal, exchange.mechanism)


__all__ = [
    "Action", "Authenticated", "BrokersSeen", "Close", "InFlight", "Mute",
    "ProxyConnection", "QuotaAdmin", "QuotaPolicy", "Throttled", "ToBroker", "ToClient",
]
