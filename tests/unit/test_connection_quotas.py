"""KIP-612 connection quotas (quotas/connection_quotas.py, quotas/ip_entities.py), pinned to Kafka.

The figures come from Kafka's `core/src/test/scala/unit/kafka/network/ConnectionQuotasTest.scala`
(apache/kafka trunk, 1eb7644, October 2024), whose broker config is `quota.window.num = 2` and
`quota.window.size.seconds = 1` (`numQuotaSamples`, `quotaWindowSizeSeconds`), listeners EXTERNAL
(client 192.168.1.1), ADMIN (192.168.1.2) and REPLICATION (192.168.1.3, the inter-broker one).
Kafka runs its blocking-acceptor tests on the system clock with tolerances; here every clock is
a plain integer of milliseconds, each Kafka tolerance is asserted, and the exact simulated figure
is pinned beside it.
"""

from __future__ import annotations

import heapq
import ipaddress
import re
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quotas.connection_quotas import (
    OVERFLOW_KEY,
    PEER_WAIT_MS,
    PEER_WAITS,
    ConnectionCountError,
    ConnectionQuotas,
    IpBucketUsage,
)
from quotas.entity import DEFAULT
from quotas.ip_entities import (
    IP_CONNECTION_RATE_UNLIMITED,
    IpEntityError,
    IpQuotas,
    PrefixTable,
    normalize_address,
    parse_ip_entity,
    parse_max_connections_per_ip_overrides,
    validate_connection_creation_rate,
)
from quotas.rate import DEFAULT_WINDOW, WindowConfig

#: ConnectionQuotasTest's quota config: 2 samples of 1 s
KAFKA_TEST_WINDOW = WindowConfig(samples=2, window_ms=1000)
EXTERNAL, ADMIN, REPLICATION = "EXTERNAL", "ADMIN", "REPLICATION"
LISTENER_IPS = {EXTERNAL: "192.168.1.1", ADMIN: "192.168.1.2", REPLICATION: "192.168.1.3"}
KNOWN_HOST, UNKNOWN_HOST = "192.168.10.0", "192.168.2.0"


def kafka_quotas(**kwargs: object) -> ConnectionQuotas:
    """The test's broker: three listeners added, REPLICATION the inter-broker (protected) one."""
    listener_rate = kwargs.pop("listener_rate", None)
    quotas = ConnectionQuotas(KAFKA_TEST_WINDOW, protected_listener=REPLICATION, **kwargs)  # type: ignore[arg-type]
    for name in LISTENER_IPS:
        quotas.set_listener_rate(name, listener_rate)  # type: ignore[arg-type]
    return quotas


@dataclass
class Acceptor:
    """Kafka's `acceptConnections` on one thread: inc (which may block for the accept delay), then
    sleep until the next send time (`timeIntervalMs` after the previous one)."""

    listener: str
    ip: str
    left: int
    interval_ms: int
    next_send_ms: int = 0
    start_ms: int = 0
    end_ms: int = 0
    accepted: int = 0
    ip_throttled: int = 0
    delayed: int = 0
    refused: int = 0

    @property
    def rate(self) -> float:
        """`acceptConnectionsAndVerifyRate`: created connections / elapsed seconds."""
        return self.accepted / ((self.end_ms - self.start_ms) / 1000.0)


def run(quotas: ConnectionQuotas, acceptors: list[Acceptor], start_ms: int = 0) -> list[Acceptor]:
    """Run acceptor threads on one simulated clock, ties taken in turn (threads interleave)."""
    heap: list[tuple[int, int, int]] = []
    turn = 0
    for index, acceptor in enumerate(acceptors):
        acceptor.start_ms = acceptor.end_ms = start_ms
        acceptor.next_send_ms = start_ms + acceptor.interval_ms
        heap.append((start_ms, turn, index))
        turn += 1
    heapq.heapify(heap)
    while heap:
        now, _, index = heapq.heappop(heap)
        acceptor = acceptors[index]
        delay = quotas.accept_delay_ms(acceptor.listener, now)
        assert 0 <= delay <= quotas.max_throttle_ms
        acceptor.delayed += delay > 0
        now += delay
        decision = quotas.check_ip(acceptor.listener, acceptor.ip, now)
        if not decision.accepted:
            acceptor.ip_throttled += 1
        elif quotas.inc(acceptor.ip) is None:
            acceptor.accepted += 1
        else:
            acceptor.refused += 1
        now += max(acceptor.next_send_ms - now, 0)
        acceptor.next_send_ms += acceptor.interval_ms
        acceptor.left -= 1
        acceptor.end_ms = now
        if acceptor.left:
            heapq.heappush(heap, (now, turn, index))
            turn += 1
    return acceptors


def on_every_listener(connections: int, interval_ms: int) -> list[Acceptor]:
    return [Acceptor(name, ip, connections, interval_ms) for name, ip in LISTENER_IPS.items()]


# -- Kafka's ConnectionQuotasTest ------------------------------------------------------------------


def test_no_connection_limits_by_default() -> None:
    """testNoConnectionLimitsByDefault: 10000 connections per listener as fast as possible, none
    waits; the broker and listener accept rates are recorded anyway; dec takes one off."""
    quotas = kafka_quotas()
    acceptors = run(quotas, on_every_listener(10_000, 0))
    assert [a.accepted for a in acceptors] == [10_000] * 3
    assert sum(a.delayed for a in acceptors) == 0
    assert quotas.broker_rate.measure(0) > 0
    for name, ip in LISTENER_IPS.items():
        assert quotas.listener_rate(name, 0) > 0
        assert quotas.open_connections(ip) == 10_000
        quotas.dec(ip)
        assert quotas.open_connections(ip) == 9_999
    assert quotas.live_buckets == 0  # no IP quota: no IP sensor at all


def test_fail_decrement_for_unknown_ip() -> None:
    """testFailDecrementForUnknownIp: dec() for an address never inc()'d throws."""
    quotas = kafka_quotas()
    with pytest.raises(ConnectionCountError, match=re.escape("192.168.2.0")):
        quotas.dec(UNKNOWN_HOST)


def test_max_connections_per_ip() -> None:
    """testMaxConnectionsPerIp: max.connections.per.ip = 17; the next two are refused; another
    address still gets 17; after closing, two more fit. Kafka counts a refused connection and its
    acceptor's closeChannel takes it off again (the test skips that close, hence its 17 + 2);
    here a refused connection is never counted, the same net count."""
    quotas = kafka_quotas(max_connections_per_ip=17)
    ip = LISTENER_IPS[EXTERNAL]
    assert [quotas.inc(ip) for _ in range(17)] == [None] * 17
    assert quotas.inc(ip) == "max_connections_per_ip = 17 reached for 192.168.1.1"
    assert quotas.inc(ip) is not None
    assert quotas.open_connections(ip) == 17
    assert [quotas.inc(KNOWN_HOST) for _ in range(17)] == [None] * 17
    quotas.dec(ip)
    quotas.dec(ip)
    assert quotas.open_connections(ip) == 15
    assert [quotas.inc(ip) for _ in range(2)] == [None, None]
    assert quotas.open_connections(ip) == 17


def test_broker_connection_rate_limit_when_actual_rate_below_limit() -> None:
    """testBrokerConnectionRateLimitWhenActualRateBelowLimit: max.connection.creation.rate = 125,
    3 listeners x 40/s (25 ms apart) = 120/s, 200 each: nobody waits, all 200 created."""
    acceptors = run(kafka_quotas(max_connection_creation_rate=125), on_every_listener(200, 25))
    assert [(a.accepted, a.delayed) for a in acceptors] == [(200, 0)] * 3


def test_broker_connection_rate_limit_when_actual_rate_above_limit() -> None:
    """testBrokerConnectionRateLimitWhenActualRateAboveLimit: broker rate 90, 3 listeners x 100/s
    (10 ms apart), 400 each: EXTERNAL and ADMIN wait, the inter-broker listener never does (it is
    exempt from the broker-wide rate); every connection is created."""
    acceptors = run(kafka_quotas(max_connection_creation_rate=90), on_every_listener(400, 10))
    by_name = {a.listener: a for a in acceptors}
    assert [a.accepted for a in acceptors] == [400] * 3
    assert by_name[EXTERNAL].delayed > 0 and by_name[ADMIN].delayed > 0
    assert by_name[REPLICATION].delayed == 0
    assert by_name[REPLICATION].rate == 100.0
    # the two throttled listeners share the broker's 90/s: 800 connections by 8833 ms (90.6/s)
    last = max(by_name[EXTERNAL].end_ms, by_name[ADMIN].end_ms)
    assert 800 / (last / 1000) == pytest.approx(90, abs=2)


def test_listener_connection_rate_limit_when_actual_rate_below_limit() -> None:
    """testListenerConnectionRateLimitWhenActualRateBelowLimit: listener rate 50, broker 125,
    40/s per listener: nobody waits."""
    acceptors = run(kafka_quotas(max_connection_creation_rate=125, listener_rate=50),
                    on_every_listener(200, 25))
    assert [(a.accepted, a.delayed) for a in acceptors] == [(200, 0)] * 3


def test_listener_connection_rate_limit_when_actual_rate_above_limit() -> None:
    """testListenerConnectionRateLimitWhenActualRateAboveLimit: listener rate 30, broker 125,
    40/s offered on every listener, 600 each: the rate is 30 +- 7 on every listener, the
    inter-broker one included (listener limits apply to it); every listener was throttled."""
    quotas = kafka_quotas(max_connection_creation_rate=125, listener_rate=30)
    acceptors = run(quotas, on_every_listener(600, 25))
    for acceptor in acceptors:
        assert acceptor.accepted == 600
        assert acceptor.rate == pytest.approx(30, abs=7)
        assert acceptor.rate == 30.0  # simulated: 600 connections in exactly 20 s
        assert quotas.listeners[acceptor.listener].throttle_count > 0


def test_ip_connection_rate_when_actual_rate_below_limit() -> None:
    """testIpConnectionRateWhenActualRateBelowLimit (MockTime): IP quota 30, 25/s for 200
    connections: rate exactly 25 (epsilon 0); an address without a quota at 50/s: exactly 50;
    nobody waits, no IP throttle on any listener."""
    quotas = kafka_quotas()
    quotas.update_ip_quota(LISTENER_IPS[EXTERNAL], 30)
    external, = run(quotas, [Acceptor(EXTERNAL, LISTENER_IPS[EXTERNAL], 200, 40)])
    assert (external.accepted, external.rate) == (200, 25.0)
    admin, = run(quotas, [Acceptor(ADMIN, LISTENER_IPS[ADMIN], 200, 20)], external.end_ms)
    assert (admin.accepted, admin.rate) == (200, 50.0)
    assert external.delayed == admin.delayed == 0
    assert all(q.ip_throttle_count == 0 for q in quotas.listeners.values())


def test_ip_connection_rate_when_actual_rate_above_limit() -> None:
    """testIpConnectionRateWhenActualRateAboveLimit (MockTime): IP quota 20, 40/s offered (25 ms
    apart), 80 connections: rate 20 +- 1; then a <default> of 20 holds another address the same
    way. IP throttles never make the acceptor wait; REPLICATION sees no IP throttle."""
    quotas = kafka_quotas()
    quotas.update_ip_quota(LISTENER_IPS[EXTERNAL], 20)
    external, = run(quotas, [Acceptor(EXTERNAL, LISTENER_IPS[EXTERNAL], 80, 25)])
    assert external.rate == pytest.approx(20, abs=1)
    assert (external.accepted, external.ip_throttled, external.end_ms) == (39, 41, 2000)
    assert quotas.listeners[EXTERNAL].ip_throttle_count == 41
    assert quotas.listeners[ADMIN].ip_throttle_count == 0
    quotas.update_ip_quota(DEFAULT, 20)
    admin, = run(quotas, [Acceptor(ADMIN, LISTENER_IPS[ADMIN], 80, 25)], external.end_ms)
    assert admin.rate == pytest.approx(20, abs=1)
    assert admin.accepted == 39
    assert quotas.listeners[ADMIN].ip_throttle_count > 0
    assert external.delayed == admin.delayed == 0
    assert quotas.listeners[REPLICATION].ip_throttle_count == 0


def test_ip_throttle_time_is_kafkas_formula() -> None:
    """The run above by hand. Rate.windowSize pads the elapsed time up to (samples - 1) whole
    windows plus the elapsed part, so at t < 1 s the window is t + 1000 ms, and with n connections
    the throttle (n / W - T) / T x W is n x 1000 / T - W. The first 39 (t = 0..950) stay at or
    under 20/s; the 40th at 975 ms is 40 / 1.975 s = 20.25/s: 2000 - 1975 = 25 ms, and it is
    un-recorded (39 stay). From 1 s the window is the elapsed time: at 1000 ms, 40 / 1 s ->
    2000 - 1000 = 1000 ms (one window, the cap); at 1500 ms, 500 ms. Nothing more fits before
    2 s, hence 39 in Kafka's 2 s (19.5/s, inside its 20 +- 1)."""
    quotas = kafka_quotas()
    ip = LISTENER_IPS[EXTERNAL]
    quotas.update_ip_quota(ip, 20)
    assert all(quotas.check_ip(EXTERNAL, ip, i * 25).accepted for i in range(39))
    decision = quotas.check_ip(EXTERNAL, ip, 975)
    assert decision.throttle_ms == 25
    assert decision.observed == pytest.approx(40 / 1.975)
    assert decision.bucket == "192.168.1.1" and decision.bound == 20
    assert quotas.ip_usage(975) == [IpBucketUsage("192.168.1.1", 39.0, pytest.approx(39 / 1.975))]  # type: ignore[arg-type]
    assert quotas.check_ip(EXTERNAL, ip, 1000).throttle_ms == 1000
    assert quotas.check_ip(EXTERNAL, ip, 1500).throttle_ms == 500
    assert quotas.check_ip(EXTERNAL, ip, 1999).throttle_ms == 1
    assert quotas.check_ip(EXTERNAL, ip, 2000).accepted


def test_ip_connection_rate_with_listener_connection_rate() -> None:
    """testIpConnectionRateWithListenerConnectionRate: IP <default> 25, listener rate 35, two
    addresses with 35 connections each, back to back: the listener blocks the acceptor, and at
    most one address reaches its IP quota first (simulated: neither does)."""
    quotas = kafka_quotas(listener_rate=35)
    quotas.update_ip_quota(DEFAULT, 25)
    acceptors = run(quotas, [Acceptor(EXTERNAL, KNOWN_HOST, 35, 0), Acceptor(EXTERNAL, UNKNOWN_HOST, 35, 0)])
    assert quotas.listeners[EXTERNAL].throttle_count > 0
    assert sum(a.ip_throttled > 0 for a in acceptors) < 2
    # simulated: while both share the listener's 35/s neither reaches 25/s; the first address
    # finishes first, and the other, alone on the listener, then meets its IP quota once
    assert [a.ip_throttled for a in acceptors] == [0, 1]


def test_rejected_ip_connection_is_unrecorded_from_the_connection_rates() -> None:
    """testRejectedIpConnectionUnrecordedFromConnectionRateQuotas: a throttled connection is taken
    back from the IP, listener and broker rates, on an ordinary and on the inter-broker listener.
    Kafka's test sets the IP quota to 0 through the internal API; the KRaft controller refuses
    0 (ClientQuotaControlManager: "must be greater than 0"), so here the quota is 1 and the
    second connection is the throttled one: every rate holds one connection, not two."""
    quotas = kafka_quotas()
    for listener in (EXTERNAL, REPLICATION):
        ip = LISTENER_IPS[listener]
        quotas.update_ip_quota(ip, 1)
        for expected in (True, False):
            assert quotas.accept_delay_ms(listener, 0) == 0
            assert quotas.check_ip(listener, ip, 0).accepted is expected
        assert quotas.ip_usage(0)[-1] == IpBucketUsage(ip, 1.0, 1.0)
        assert quotas.listeners[listener].rate.total(0) == 1.0
    # the inter-broker listener is never charged to the broker rate: only EXTERNAL's one is there
    assert quotas.broker_rate.total(0) == 1.0


def test_max_listener_connection_rate_must_be_above_zero() -> None:
    """testMaxListenerConnectionListenerMustBeAboveZero: a listener rate of 0 is refused."""
    quotas = kafka_quotas()
    with pytest.raises(ValueError, match=r"listener.name.EXTERNAL.max.connection.creation.rate .* got 0"):
        quotas.set_listener_rate(EXTERNAL, 0)


def test_max_listener_connection_rate_reconfiguration() -> None:
    """testMaxListenerConnectionRateReconfiguration: a listener rate of 20 removed again lets 1000
    connections through as fast as possible; then 10/s holds 200 offered at 200/s to 10 +- 3."""
    quotas = kafka_quotas(listener_rate=20)
    quotas.set_listener_rate(EXTERNAL, None)
    fast, = run(quotas, [Acceptor(EXTERNAL, LISTENER_IPS[EXTERNAL], 1000, 0)])
    assert (fast.accepted, fast.delayed) == (1000, 0)
    quotas = kafka_quotas(listener_rate=10)
    limited, = run(quotas, [Acceptor(EXTERNAL, LISTENER_IPS[EXTERNAL], 200, 5)])
    assert limited.rate == pytest.approx(10, abs=3)
    assert (limited.end_ms, limited.delayed > 0) == (19_000, True)


def test_max_broker_connection_rate_reconfiguration() -> None:
    """testMaxBrokerConnectionRateReconfiguration: broker rate set to 50 at run time; 400
    connections offered at 200/s come in at 50 +- 20 (simulated: 400 in 7 s, 57.1/s: the
    padded window lets the first second burst)."""
    quotas = kafka_quotas()
    quotas.set_broker_rate(50)
    acceptor, = run(quotas, [Acceptor(EXTERNAL, LISTENER_IPS[EXTERNAL], 400, 5)])
    assert acceptor.rate == pytest.approx(50, abs=20)
    assert acceptor.end_ms == 7000


def test_non_default_connection_rate_limit() -> None:
    """testNonDefaultConnectionCountLimitAndRateLimit (its rate half): broker rate 25, 100/s
    offered, 350 connections: 25 +- 8 (simulated: 350 in 13 s)."""
    acceptor, = run(kafka_quotas(max_connection_creation_rate=25),
                    [Acceptor(EXTERNAL, LISTENER_IPS[EXTERNAL], 350, 10)])
    assert acceptor.rate == pytest.approx(25, abs=8)
    assert acceptor.end_ms == 13_000


def test_ip_connection_rate_metric_update() -> None:
    """testIpConnectionRateMetricUpdate: default 50 for both live IP buckets; an override of 30
    for EXTERNAL; the default changed to 20 reaches ADMIN's live bucket but not EXTERNAL's;
    removing the default leaves ADMIN unlimited, removing the override EXTERNAL."""
    quotas = kafka_quotas()
    external, admin = LISTENER_IPS[EXTERNAL], LISTENER_IPS[ADMIN]
    quotas.update_ip_quota(DEFAULT, 50)
    quotas.check_ip(EXTERNAL, external, 0)
    quotas.check_ip(ADMIN, admin, 0)

    def bounds() -> dict[str, int | None]:
        return {key: bucket.bound for key, bucket in quotas.buckets.items()}

    assert bounds() == {external: 50, admin: 50}
    quotas.update_ip_quota(external, 30)
    assert bounds() == {external: 30, admin: 50}
    quotas.update_ip_quota(DEFAULT, 20)
    assert bounds() == {external: 30, admin: 20}
    assert (quotas.ip_quotas.rate_for(external), quotas.ip_quotas.rate_for(admin)) == (30, 20)
    quotas.update_ip_quota(DEFAULT, None)
    assert bounds() == {external: 30, admin: None}
    assert quotas.ip_quotas.rate_for(admin) == IP_CONNECTION_RATE_UNLIMITED
    quotas.update_ip_quota(external, None)
    assert quotas.ip_quotas.rate_for(external) == IP_CONNECTION_RATE_UNLIMITED


def test_enforced_ip_connection_rate_quota_update() -> None:
    """testEnforcedIpConnectionRateQuotaUpdate (MockTime, the clock never moves): quota 20, 40
    connections -> 20 open; raised to 30 -> 30 open; removed -> all 40 more (70); another address
    with no quota -> 40; a <default> of 20 then admits 20 more from it (60): while it had no
    quota nothing was recorded for it."""
    quotas = kafka_quotas()
    external, admin = LISTENER_IPS[EXTERNAL], LISTENER_IPS[ADMIN]

    def connect(listener: str, ip: str, count: int) -> None:
        for _ in range(count):
            if quotas.check_ip(listener, ip, 0).accepted:
                assert quotas.inc(ip) is None

    quotas.update_ip_quota(external, 20)
    connect(EXTERNAL, external, 40)
    assert quotas.open_connections(external) == 20
    quotas.update_ip_quota(external, 30)
    connect(EXTERNAL, external, 40)
    assert quotas.open_connections(external) == 30
    quotas.update_ip_quota(external, None)
    connect(EXTERNAL, external, 40)
    assert quotas.open_connections(external) == 70
    connect(ADMIN, admin, 40)
    assert quotas.open_connections(admin) == 40
    quotas.update_ip_quota(DEFAULT, 20)
    connect(ADMIN, admin, 40)
    assert quotas.open_connections(admin) == 60
    assert all(q.throttle_count == 0 for q in quotas.listeners.values())  # the acceptor never waited


# -- the arithmetic around the figures ------------------------------------------------------------


def test_broker_and_listener_delays_combine_by_max_each_capped_at_one_window() -> None:
    """recordConnectionAndGetThrottleTimeMs: max(broker, listener), each boundedThrottleTime
    (capped at quota.window.size.seconds). Broker 10/s, listener 5/s, 2 samples of 1 s, all at t=0:
    the 6th is 6/s on the listener -> (6 - 5) / 5 x 1000 = 200 ms; the 11th is 100 ms on the
    broker but 1200 on the listener, capped to 1000. Nothing is un-recorded: the 12th is 1000 too."""
    quotas = ConnectionQuotas(KAFKA_TEST_WINDOW, max_connection_creation_rate=10, listener_rates={"L": 5})
    delays = [quotas.accept_delay_ms("L", 0) for _ in range(12)]
    assert delays[:5] == [0] * 5
    assert delays[5] == 200
    assert delays[10:] == [1000, 1000]
    quotas = ConnectionQuotas(KAFKA_TEST_WINDOW, max_connection_creation_rate=10, listener_rates={"L": 100})
    assert [quotas.accept_delay_ms("L", 0) for _ in range(11)][-1] == 100  # the broker alone
    assert quotas.listeners["L"].throttle_count == 1
    assert quotas.listeners["L"].blocked_until_ms == 100


def test_accept_delay_names_the_rate_that_decided_it() -> None:
    """For the metrics: which rate made the acceptor wait (the larger throttle; the proxy's on a tie)."""
    quotas = ConnectionQuotas(KAFKA_TEST_WINDOW, max_connection_creation_rate=10, listener_rates={"L": 5})
    decided = [quotas.accept_delay("L", 0) for _ in range(6)]
    assert decided[:5] == [(0, None)] * 5
    assert decided[5] == (200, "listener_rate")
    quotas = ConnectionQuotas(KAFKA_TEST_WINDOW, max_connection_creation_rate=10, listener_rates={"L": 100})
    assert [quotas.accept_delay("L", 0) for _ in range(11)][-1] == (100, "proxy_rate")


def test_a_broker_rate_of_zero_delays_every_connection_one_window() -> None:
    """Kafka's max.connection.creation.rate is an INT at least 0; at 0, (O - 0) / 0 is infinite and
    the bounded throttle is the window (1000 ms by default)."""
    quotas = ConnectionQuotas(max_connection_creation_rate=0)
    assert [quotas.accept_delay_ms("L", t) for t in (0, 1000, 2000)] == [1000] * 3
    with pytest.raises(ValueError, match=re.escape("max.connection.creation.rate")):
        quotas.set_broker_rate(-1)


def test_the_protected_listener_is_only_protected_beside_another_listener() -> None:
    """protectedListener: the inter-broker listener is exempt only once there are two listeners."""
    quotas = ConnectionQuotas(KAFKA_TEST_WINDOW, max_connection_creation_rate=1, protected_listener="R")
    assert [quotas.accept_delay_ms("R", 0) for _ in range(2)] == [0, 1000]
    quotas.set_listener_rate("C", None)
    assert quotas.accept_delay_ms("R", 0) == 0


def test_the_ip_throttle_is_capped_at_one_window() -> None:
    """recordIpConnectionMaybeThrottle uses the same boundedThrottleTime. Alone, an IP bucket is
    never more than one connection over (it un-records), so its throttle is ~1000 / quota ms;
    peers' usage can push it far over, and then the cap applies."""
    quotas = ConnectionQuotas(KAFKA_TEST_WINDOW, ip_quotas=IpQuotas({"10.0.0.1": 20}))
    quotas.attach_peers(lambda key, now: 400.0 if key == "10.0.0.1" else 0.0)
    decision = quotas.check_ip("L", "10.0.0.1", 0)
    assert decision.observed == pytest.approx(401.0)
    assert decision.throttle_ms == 1000  # (401 - 20) / 20 x 1000 = 19050, capped


def test_default_window_figures() -> None:
    """With Kafka's defaults (11 samples of 1 s) a new address is measured over 10 s: a quota of 2
    admits 20 at once, the 21st is (2.1 - 2) / 2 x 10000 = 500 ms."""
    quotas = ConnectionQuotas(DEFAULT_WINDOW, ip_quotas=IpQuotas({DEFAULT: 2}))
    assert all(quotas.check_ip("L", "10.0.0.1", 0).accepted for _ in range(20))
    assert quotas.check_ip("L", "10.0.0.1", 0).throttle_ms == 500


def test_an_exact_entity_at_int_max_exempts_the_address() -> None:
    """ConnectionQuotas records nothing when the rate is IP_CONNECTION_RATE_DEFAULT (Int.MaxValue):
    an exact entity set to it overrides a default."""
    quotas = ConnectionQuotas(ip_quotas=IpQuotas({DEFAULT: 1, "10.0.0.1": 2**31 - 1}))
    assert all(quotas.check_ip("L", "10.0.0.1", 0).bucket is None for _ in range(50))
    assert quotas.live_buckets == 0


def test_a_refused_connection_stays_recorded_in_the_rates() -> None:
    """Kafka's inc: the rate checks come first, then max.connections.per.ip; a refusal there does
    not un-record (only an IP throttle does)."""
    quotas = ConnectionQuotas(KAFKA_TEST_WINDOW, ip_quotas=IpQuotas({DEFAULT: 100}), max_connections_per_ip=1)
    for _ in range(2):
        quotas.accept_delay_ms("L", 0)
        assert quotas.check_ip("L", "10.0.0.1", 0).accepted
    assert [quotas.inc("10.0.0.1"), quotas.inc("10.0.0.1") is not None] == [None, True]
    assert quotas.ip_usage(0)[0].connections == 2.0
    assert quotas.listeners["L"].rate.total(0) == 2.0


# -- CIDR entities --------------------------------------------------------------------------------


IPV6_QUOTAS = {"2001:db8::/32": 100, "2001:db8:1::/48": 10, "2001:db8:1::5": 50, DEFAULT: 5}


@pytest.mark.parametrize(("address", "bucket", "bound", "level"), [
    ("2001:db8:1::5", "2001:db8:1::5", 50, "ip"),
    ("2001:db8:1::6", "2001:db8:1::/48", 10, "cidr"),
    ("2001:db8:2::1", "2001:db8::/32", 100, "cidr"),
    ("2001:dead::1", "2001:dead::1", 5, "default"),
    ("10.9.9.9", "10.9.9.9", 5, "default"),
])
def test_precedence_exact_then_longest_prefix_then_default(address: str, bucket: str, bound: int,
                                                           level: str) -> None:
    found = IpQuotas(IPV6_QUOTAS).resolve(normalize_address(address))
    assert found is not None
    assert (found.bucket, found.bound, found.level) == (bucket, bound, level)


def test_ipv4_prefixes_and_mapped_addresses() -> None:
    quotas = IpQuotas({"10.1.0.0/16": 40, "10.1.2.0/24": 20, "::ffff:10.1.2.7": 7})
    assert quotas.entities() == {"10.1.0.0/16": 40, "10.1.2.0/24": 20, "10.1.2.7": 7}
    resolved = {a: quotas.resolve(normalize_address(a)) for a in
                ("10.1.2.7", "::ffff:10.1.2.8", "10.1.3.1", "10.2.0.1")}
    assert {a: r and (r.bucket, r.bound) for a, r in resolved.items()} == {
        "10.1.2.7": ("10.1.2.7", 7), "::ffff:10.1.2.8": ("10.1.2.0/24", 20),
        "10.1.3.1": ("10.1.0.0/16", 40), "10.2.0.1": None}


@pytest.mark.parametrize(("name", "canonical"), [
    ("<default>", DEFAULT), (" 10.0.0.1 ", "10.0.0.1"), ("::ffff:10.0.0.1", "10.0.0.1"),
    ("2001:DB8::1", "2001:db8::1"), ("fe80::1%eth0", "fe80::1"), ("10.0.0.1/32", "10.0.0.1"),
    ("::ffff:10.1.0.0/112", "10.1.0.0/16"), ("2001:db8::/32", "2001:db8::/32"),
])
def test_entity_names_are_normalised(name: str, canonical: str) -> None:
    assert parse_ip_entity(name) == canonical


@pytest.mark.parametrize(("name", "message"), [
    ("10.1.2.5/24", "'10.1.2.5/24' is not a valid CIDR prefix: 10.1.2.5/24 has host bits set"),
    ("kafka.example.com", "'kafka.example.com' is not an IP address, a CIDR prefix or <default>"),
    ("10.0.0.0/33", "'10.0.0.0/33' is not a valid CIDR prefix"),
    ("", "'' is not an IP address"),
])
def test_invalid_entities_name_the_value(name: str, message: str) -> None:
    with pytest.raises(IpEntityError, match=re.escape(message)):
        IpQuotas({name: 10})


@pytest.mark.parametrize(("value", "message"), [
    (0, "must be greater than 0, got 0"), (-5, "must be greater than 0, got -5"),
    (1.5, "cannot be a fractional value: 1.5"), (float("nan"), "must be greater than 0, got nan"),
    (float("inf"), "must be greater than 0, got inf"), (True, "must be a number, got True"),
    ("20", "must be a number, got '20'"), (2**31, "is too large for an INT: 2147483648"),
])
def test_invalid_rates_follow_kafkas_controller(value: object, message: str) -> None:
    """ClientQuotaControlManager.validateQuotaKeyValue: <= 0 refused, an INT key refuses fractions
    (remainder > 1e-6) and values above Int.MaxValue."""
    with pytest.raises(IpEntityError, match=re.escape(f"connection_creation_rate for ip 10.0.0.1 {message}")):
        validate_connection_creation_rate(value, "10.0.0.1")


def test_integral_floats_are_taken_as_kafka_takes_them() -> None:
    assert validate_connection_creation_rate(20.0, "x") == 20
    assert validate_connection_creation_rate(20.0000001, "x") == 20  # within 1e-6, then toInt


def test_two_names_for_one_entity_are_refused() -> None:
    with pytest.raises(IpEntityError, match=re.escape("'10.0.0.1' and '10.0.0.1/32' are the same entity")):
        IpQuotas({"10.0.0.1": 1, "10.0.0.1/32": 2})


def test_an_invalid_client_address_names_it() -> None:
    with pytest.raises(IpEntityError, match="'not-an-ip' is not an IP address"):
        ConnectionQuotas(ip_quotas=IpQuotas({DEFAULT: 5})).check_ip("L", "not-an-ip", 0)
    with pytest.raises(IpEntityError, match="'' is not an IP address"):
        ConnectionQuotas().inc("")


def test_a_prefix_entity_charges_one_bucket_for_the_whole_prefix() -> None:
    """The same storm, per address then with a /24 entity: 200 addresses of 10.1.2.0/24 each connect
    once a second for 36 s. A <default> of 20 per address admits all 7200; "10.1.2.0/24" = 20
    holds the whole /24 to 20 a second, in Kafka's Rate's sawtooth (11 samples of 1 s): the
    padded 10 s window's burst, 19 more, nothing until the first samples age out, then again:
    240 per 12 s."""
    hosts = [f"10.1.2.{i}" for i in range(1, 201)]

    def storm(quotas: ConnectionQuotas) -> list[int]:
        per_second = [0] * 36
        for second in range(36):
            for i, host in enumerate(hosts):
                now = second * 1000 + i * 5
                quotas.accept_delay_ms("L", now)
                per_second[second] += quotas.check_ip("L", host, now).accepted
        return per_second

    assert sum(storm(ConnectionQuotas(ip_quotas=IpQuotas({DEFAULT: 20})))) == 7200
    shared = ConnectionQuotas(ip_quotas=IpQuotas({DEFAULT: 20, "10.1.2.0/24": 20}))
    per_second = storm(shared)
    assert shared.live_buckets == 1 and next(iter(shared.buckets)) == "10.1.2.0/24"
    assert per_second[:13] == [200, 19] + [0] * 9 + [21, 199]
    assert sum(per_second) == 3 * 240 == 20 * 36


def test_a_quota_change_reaches_prefix_buckets_and_retires_orphans() -> None:
    quotas = ConnectionQuotas(ip_quotas=IpQuotas({DEFAULT: 5}))
    quotas.check_ip("L", "10.1.2.3", 0)
    quotas.update_ip_quota("10.1.2.0/24", 8)
    quotas.check_ip("L", "10.1.2.3", 0)
    # the per-address bucket no longer applies (its key changed); it keeps its history, uncharged
    assert {k: b.bound for k, b in quotas.buckets.items()} == {"10.1.2.3": None, "10.1.2.0/24": 8}
    assert [u.bucket for u in quotas.ip_usage(0)] == ["10.1.2.0/24"]
    quotas.update_ip_quota("10.1.2.0/24", 9)
    assert quotas.buckets["10.1.2.0/24"].bound == 9
    quotas.update_ip_quota("10.1.2.0/24", None)
    assert {k: b.bound for k, b in quotas.buckets.items()} == {"10.1.2.3": 5, "10.1.2.0/24": None}
    assert quotas.ip_usage(0) == [IpBucketUsage("10.1.2.3", 1.0, pytest.approx(0.1))]  # type: ignore[arg-type]


# -- max.connections.per.ip.overrides -------------------------------------------------------------


def test_overrides_parse_as_kafkas_csv_map() -> None:
    """Csv.parseCsvMap: split on commas, each at its last colon (IPv6 keeps its colons)."""
    assert parse_max_connections_per_ip_overrides("127.0.0.1:200 , 2001:db8::1:100,10.0.0.0/8:5") == {
        "127.0.0.1": 200, "2001:db8::1": 100, "10.0.0.0/8": 5}
    assert parse_max_connections_per_ip_overrides("") == {}
    assert parse_max_connections_per_ip_overrides("10.0.0.1:1,10.0.0.1:2") == {"10.0.0.1": 2}


@pytest.mark.parametrize(("text", "message"), [
    ("10.0.0.1", "entry '10.0.0.1' is not host:count"),
    ("kafka.example.com:5", "'kafka.example.com' is not an IP address"),
    ("10.0.0.1:x", "count 'x' is not an integer"),
    ("10.0.0.1:-1", "count must be >= 0"),
])
def test_invalid_overrides_name_the_entry(text: str, message: str) -> None:
    with pytest.raises(IpEntityError, match=re.escape(message)):
        parse_max_connections_per_ip_overrides(text)


def test_max_connections_per_ip_overrides_by_address_and_prefix() -> None:
    quotas = ConnectionQuotas(max_connections_per_ip=2,
                              max_connections_per_ip_overrides="10.0.0.1:3,10.0.0.0/8:1,10.0.0.0/16:0")
    assert [quotas.inc("10.0.0.1") for _ in range(4)][-1] == (
        "max_connections_per_ip_overrides 10.0.0.1 = 3 reached for 10.0.0.1")
    assert quotas.inc("10.0.9.9") == "max_connections_per_ip_overrides 10.0.0.0/16 = 0 reached for 10.0.9.9"
    assert [quotas.inc("10.5.0.1"), quotas.inc("10.5.0.1")][1] is not None  # /8: one each
    assert [quotas.inc("::ffff:10.5.0.2")] == [None]  # per address, not shared by the prefix
    assert [quotas.inc("192.0.2.1") for _ in range(3)] == [None, None, "max_connections_per_ip = 2 reached "
                                                                        "for 192.0.2.1"]


def test_max_connections_per_ip_zero_needs_overrides() -> None:
    """KafkaConfig: max.connections.per.ip can be set to zero only if the overrides are set."""
    with pytest.raises(ValueError, match="can be set to zero only if"):
        ConnectionQuotas(max_connections_per_ip=0)
    with pytest.raises(IpEntityError, match="cannot name <default>"):
        ConnectionQuotas(max_connections_per_ip_overrides={DEFAULT: 1})
    quotas = ConnectionQuotas(max_connections_per_ip=0, max_connections_per_ip_overrides={"10.0.0.1": 1})
    assert (quotas.inc("10.0.0.1"), quotas.inc("10.0.0.2") is not None) == (None, True)


# -- the bucket bound -----------------------------------------------------------------------------


def test_a_storm_of_addresses_cannot_grow_the_buckets_past_the_bound() -> None:
    """max_quota_buckets: past it, addresses under <default> share the overflow bucket at the
    default's rate; configured entities still get their own; expired buckets make room."""
    quotas = ConnectionQuotas(KAFKA_TEST_WINDOW, ip_quotas=IpQuotas({DEFAULT: 5, "192.0.2.1": 9}),
                              max_buckets=100)
    decisions = [quotas.check_ip("L", str(ipaddress.IPv4Address(0x0A000000 + i)), 0) for i in range(10_000)]
    assert quotas.live_buckets == 101  # 100 addresses + the overflow bucket
    assert quotas.overflow_charges == 9_900
    assert sum(d.accepted for d in decisions) == 100 + 5  # one each, then the group's 5
    assert {d.bucket for d in decisions[100:]} == {OVERFLOW_KEY}
    assert quotas.check_ip("L", "192.0.2.1", 0).bucket == "192.0.2.1"
    assert quotas.live_buckets == 102
    # 2 samples x 1 s after, nothing holds history: new addresses take expired buckets' places
    assert quotas.check_ip("L", "10.200.0.1", 2000).bucket == "10.200.0.1"
    assert quotas.evicted_buckets == 1
    assert quotas.expire_idle(2000) == 101 and quotas.live_buckets == 1


# -- the fleet ------------------------------------------------------------------------------------


def test_peers_rates_are_added_into_the_decision() -> None:
    """Quota 20, 2 samples of 1 s; peers report 15/s for the bucket: 5 local connections fit
    (5 + 15 = 20), the 6th is 21 -> (21 - 20) / 20 x 1000 = 50 ms. ip_usage lists the local part.
    (Each connection has waited for the peers PEER_WAITS times: Kafka's formula alone decides.)"""
    quotas = ConnectionQuotas(KAFKA_TEST_WINDOW, ip_quotas=IpQuotas({"10.1.2.0/24": 20}))
    quotas.attach_peers(lambda key, now: 15.0 if key == "10.1.2.0/24" else 0.0)
    decisions = [quotas.check_ip("L", f"10.1.2.{i}", 0, waits=PEER_WAITS) for i in range(6)]
    assert [d.throttle_ms for d in decisions] == [0] * 5 + [50]
    assert quotas.ip_usage(0) == [IpBucketUsage("10.1.2.0/24", 5.0, 5.0)]
    quotas.attach_peers(None)
    assert quotas.check_ip("L", "10.1.2.9", 0).accepted


def test_a_member_takes_its_part_of_the_headroom_then_waits_for_its_peers() -> None:
    """Quota 20 (2 samples of 1 s), peers at 10/s: the headroom is 10 connections, this member's part
    5. The 6th waits PEER_WAIT_MS, un-recorded; once the peers report 12/s (news), the part is half
    of what is left (20 - 5 - 12 = 3, so 1.5: one connection). Past PEER_WAITS waits Kafka's formula
    alone decides: two more fit (6 + 2 + 12 = 20), the next is throttled as before."""
    peers = {"rate": 10.0}
    quotas = ConnectionQuotas(KAFKA_TEST_WINDOW, ip_quotas=IpQuotas({"10.1.2.0/24": 20}))
    quotas.attach_peers(lambda key, now: peers["rate"])
    first = [quotas.check_ip("L", "10.1.2.1", 0) for _ in range(6)]
    assert [d.accepted for d in first] == [True] * 5 + [False]
    assert first[5].wait_ms == PEER_WAIT_MS and first[5].throttle_ms == 0
    assert quotas.ip_usage(0) == [IpBucketUsage("10.1.2.0/24", 5.0, 5.0)]  # the waiting one is not counted
    peers["rate"] = 12.0
    again = [quotas.check_ip("L", "10.1.2.1", 0, waits=1) for _ in range(2)]
    assert [(d.accepted, d.wait_ms) for d in again] == [(True, 0), (False, PEER_WAIT_MS)]
    last = [quotas.check_ip("L", "10.1.2.1", 0, waits=PEER_WAITS).throttle_ms for _ in range(3)]
    assert last == [0, 0, 50]


def test_quiet_or_fading_peers_hold_nothing_back() -> None:
    """No peer rate: Kafka's formula alone. A fading peers' rate (a stale report, weighted down as
    it ages) is news on every connection: the member is never held to a part of an old headroom."""
    quotas = ConnectionQuotas(KAFKA_TEST_WINDOW, ip_quotas=IpQuotas({"10.1.2.0/24": 20}))
    quotas.attach_peers(lambda key, now: 0.0)
    assert all(quotas.check_ip("L", "10.1.2.1", 0).accepted for _ in range(20))
    quotas = ConnectionQuotas(KAFKA_TEST_WINDOW, ip_quotas=IpQuotas({"10.1.2.0/24": 20}))
    quotas.attach_peers(lambda key, now: 10.0 * (1.0 - now / 10_000))
    assert all(quotas.check_ip("L", "10.1.2.1", t).accepted for t in range(1, 9))


# -- properties -----------------------------------------------------------------------------------

ARRIVALS = st.lists(st.tuples(st.integers(0, 400), st.integers(0, 3)), min_size=1, max_size=150)


@settings(max_examples=200, deadline=None)
@given(arrivals=ARRIVALS, bound=st.integers(1, 50), samples=st.integers(2, 11),
       window_ms=st.sampled_from([100, 250, 1000]))
def test_accepted_connections_stay_within_the_window(arrivals: list[tuple[int, int]], bound: int,
                                                     samples: int, window_ms: int) -> None:
    """Over any arrival sequence: (1) at every acceptance, the connections the bucket holds are at
    most bound x its measured window + 1 (the +1 is Math.round's slack); (2) un-recording keeps
    the bucket's count equal to the connections accepted while nothing has aged out; (3) in any
    span of (samples - 1) windows at most bound x (samples + 1) windows + 1 are accepted, however
    the samples fall."""
    window = WindowConfig(samples, window_ms)
    quotas = ConnectionQuotas(window, ip_quotas=IpQuotas({DEFAULT: bound}))
    now = 0
    accepted: list[int] = []
    for gap, address in arrivals:
        now += gap
        decision = quotas.check_ip("L", f"10.0.0.{address}", now)
        rate = quotas.buckets[f"10.0.0.{address}"].rate
        held, measured_ms = rate.total(now), rate.window_ms(now)
        if decision.accepted:
            assert held <= bound * measured_ms / 1000 + 1
            if address == 0:
                accepted.append(now)
        else:
            assert 0 < decision.throttle_ms <= window_ms
        if address == 0 and now < window.history_ms:
            assert held == len(accepted)
    span = (samples - 1) * window_ms
    for i, end in enumerate(accepted):
        inside = sum(1 for t in accepted[: i + 1] if t > end - span)
        assert inside <= bound * (samples + 1) * window_ms / 1000 + 1


@settings(max_examples=150, deadline=None)
@given(arrivals=ARRIVALS, budget=st.integers(1, 5))
def test_expiring_buckets_changes_no_decision(arrivals: list[tuple[int, int]], budget: int) -> None:
    """A bucket dropped once its rate holds no history measures as a new one: an instance expiring
    before every arrival decides exactly as one that never expires."""
    window = WindowConfig(2, 250)
    eager = ConnectionQuotas(window, ip_quotas=IpQuotas({DEFAULT: 3}))
    never = ConnectionQuotas(window, ip_quotas=IpQuotas({DEFAULT: 3}), max_buckets=None)
    now = 0
    for gap, address in arrivals:
        now += gap * 3
        eager.expire_idle(now, budget)
        ip = f"10.0.0.{address}"
        assert eager.check_ip("L", ip, now) == never.check_ip("L", ip, now)


@settings(max_examples=200, deadline=None)
@given(entries=st.dictionaries(
    st.tuples(st.integers(0, 255), st.integers(8, 32)), st.integers(1, 100), max_size=12),
    exact=st.dictionaries(st.integers(0, 255), st.integers(1, 100), max_size=4),
    default=st.none() | st.integers(1, 100), probe=st.integers(0, 255), host=st.integers(0, 255))
def test_prefix_lookup_matches_a_brute_force_search(entries: dict[tuple[int, int], int],
                                                    exact: dict[int, int], default: int | None,
                                                    probe: int, host: int) -> None:
    """PrefixTable.lookup against the definition: exact, else the longest prefix containing the
    address, else <default>."""
    table: dict[str, int] = {}
    networks: dict[ipaddress.IPv4Network, int] = {}
    for (first, length), value in entries.items():
        network = ipaddress.IPv4Network((first << 24, length), strict=False)
        if network.prefixlen < 32 and str(network) not in table:
            table[str(network)] = value
            networks[network] = value
    addresses = {ipaddress.IPv4Address((a << 24) | (host << 8) | 1): v for a, v in exact.items()}
    table.update({str(a): v for a, v in addresses.items()})
    if default is not None:
        table[DEFAULT] = default
    address = ipaddress.IPv4Address((probe << 24) | (host << 8) | 1)
    if address in addresses:
        expected: tuple[str, int] | None = (str(address), addresses[address])
    else:
        containing = [n for n in networks if address in n]
        if containing:
            best = max(containing, key=lambda n: n.prefixlen)
            expected = (str(best), networks[best])
        else:
            expected = None if default is None else (DEFAULT, default)
    match = PrefixTable(table).lookup(address)
    assert (None if match is None else (match.entity, match.value)) == expected
