"""The per-broker concurrency limit (quotas/broker_concurrency.py), and how a connection
waits for a slot (protocol/connection.py), driven with values and byte strings."""

from __future__ import annotations

from collections.abc import Hashable

from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.broker_admission import CATCHING_UP_BYTES, FETCH_BYTES_WHILE_LIMITED
from protocol.connection import STREAM_MIN_BYTES, AwaitSlot, ProxyConnection
from protocol.headers import parse_request_header
from quotas.broker_concurrency import (
    ACTIVE_MS,
    AVOIDANCE_STEP,
    AVOIDANCE_WINDOWS,
    MAX_LIMIT,
    MIN_LIMIT,
    WINDOW_MS,
    BrokerConcurrency,
    BrokerSlots,
    tail,
)

from .test_connection import produce_request, produce_response
from .test_streaming import fetch_request, fetch_response
from .test_throttling import decode_request
from .wire import advertise, broker_frames, framed, of_type, to_client

GOLD, SILVER, BRONZE = "gold", "silver", "bronze"


def limited(limit: float) -> BrokerSlots[str]:
    slots: BrokerSlots[str] = BrokerSlots(1)
    slots.limit = limit
    return slots


def test_the_limit_holds_every_tenant() -> None:
    slots = limited(MIN_LIMIT)
    assert slots.acquire(SILVER, 1.0, "s1", 0.0)
    assert not slots.acquire(SILVER, 1.0, "s2", 0.0)
    assert not slots.acquire(GOLD, 10.0, "g1", 0.0)  # gold too: one request at the broker is the limit
    assert slots.release(SILVER) == ["g1"]  # but first when the slot frees: 1 / 10 against silver's 1 / 1
    assert slots.in_flight == 1 and slots.waiting == 1


def test_in_shadow_a_request_over_the_limit_goes_and_says_it_would_have_waited() -> None:
    slots = limited(MIN_LIMIT)
    assert slots.start_anyway(SILVER, 1.0, 0.0), "within the limit"
    assert not slots.start_anyway(GOLD, 10.0, 0.0), "over it: would have waited"
    assert slots.in_flight == 2 and slots.waiting == 0, "both counted, nothing waits"
    assert slots.release(GOLD) == [] and slots.release(SILVER) == []
    assert slots.in_flight == 0


def test_a_tenant_with_a_whole_slot_of_share_owns_one_and_a_freed_slot_goes_to_the_fewest_per_share() -> None:
    slots = limited(3)
    assert slots.acquire(GOLD, 10.0, "g1", 0.0)
    assert slots.acquire(SILVER, 1.0, "s1", 0.0)
    assert slots.acquire(BRONZE, 1.0, "b1", 0.0)
    assert slots.owned(GOLD) == 1 and slots.owned(SILVER) == 0  # 3 x 10 / 12 slots of share: one owned
    assert not slots.acquire(SILVER, 1.0, "s2", 0.0)
    assert not slots.acquire(GOLD, 10.0, "g2", 0.0)  # its one slot is in use: it waits like anyone
    assert slots.release(GOLD) == ["g2"]  # first: 1 in flight / 10 against silver's 2 / 1
    assert slots.release(GOLD) == [], "gold's slot stays free for gold, though only 2 are in flight"
    assert slots.release(BRONZE) == ["s2"]
    assert slots.in_flight == 2 and slots.waiting == 0


def test_a_tenant_that_stopped_asking_gives_its_slots_back() -> None:
    slots = limited(2)
    assert slots.acquire(GOLD, 10.0, "g1", 0.0)
    assert slots.release(GOLD) == []
    assert slots.acquire(SILVER, 1.0, "s1", 10.0)
    assert slots.owned(GOLD) == 1
    assert not slots.acquire(SILVER, 1.0, "s2", 20.0), "gold's one slot stays its own while it is active"
    assert slots.release(SILVER) == ["s2"], "with nothing in flight, anyone goes"
    assert slots.acquire(SILVER, 1.0, "s3", ACTIVE_MS + 1.0), "gold idle a second: its slot is shared"
    assert slots.owned(GOLD) == 0


def test_share_buys_slots_in_proportion() -> None:
    """Both always waiting, requests completing oldest first: the slots settle at 10 to 1."""
    slots = limited(11)
    running: list[str] = []
    for n in range(200):
        for tenant, weight in ((GOLD, 10.0), (SILVER, 1.0)):
            if slots.acquire(tenant, weight, f"{tenant}-{n}", 0.0):
                running.append(tenant)
    for _ in range(100):
        running += [waiter.split("-")[0] for waiter in slots.release(running.pop(0))]
    assert sorted(running).count(GOLD) == 10 and running.count(SILVER) == 1, running


def test_equal_tenants_are_served_first_come_first_served() -> None:
    slots = limited(2)  # four tenants of share 1: nobody owns a whole slot
    assert slots.acquire("a", 1.0, "a1", 0.0) and slots.acquire("b", 1.0, "b1", 0.0)
    assert not slots.acquire("c", 1.0, "c1", 0.0)
    assert not slots.acquire("d", 1.0, "d1", 0.0)
    assert slots.owned("a") == 0
    assert slots.release("b") == ["c1"]  # both none in flight: c waited longer


def test_a_cancelled_waiter_is_never_woken() -> None:
    slots = limited(1)
    assert slots.acquire(SILVER, 1.0, "s1", 0.0)
    assert not slots.acquire(SILVER, 1.0, "s2", 0.0)
    slots.cancel(SILVER, "s2")
    assert slots.waiting == 0
    assert slots.release(SILVER) == []
    assert slots.in_flight == 0
    assert slots.release(SILVER) == []  # a release with nothing in flight changes nothing


def test_a_full_window_is_judged_by_its_p99_a_light_one_by_its_p90() -> None:
    assert tail([1.0] * 196 + [50.0] * 4) == 50.0  # 2 % slow in a full window: a queue
    assert tail([1.0] * 49 + [50.0]) == 1.0  # one slow answer among 50: noise


def window(slots: BrokerSlots[str], latencies: list[float], start: float, bound: float | None) -> object:
    """One window of completed requests; the change at its end."""
    change = None
    for i, latency in enumerate(latencies):
        change = slots.sample(latency, start + i, bound)
    return slots.sample(latencies[-1], start + WINDOW_MS, bound) or change


def test_the_limit_is_cut_from_what_was_in_flight_and_grows_by_its_square_root() -> None:
    slots = limited(MAX_LIMIT)
    for n in range(10):
        slots.acquire(f"t{n}", 1.0, f"w{n}", 0.0)
    slots.sample(1.0, 0.0, None)  # opens the window; the peak so far is 10
    change = window(slots, [30.0] * 5, 1.0, bound=9.0)
    assert change is not None and slots.limit == 10 * 0.7  # from the 10 in flight, not from 64
    change = window(slots, [3.0] * 5, 2 * WINDOW_MS + 10, bound=9.0)
    assert change is not None and abs(slots.limit - (7.0 + 7.0 ** 0.5)) < 1e-9


def test_after_a_cut_while_fetches_held_slots_the_limit_grows_by_a_step_then_by_its_square_root() -> None:
    concurrency: BrokerConcurrency[str] = BrokerConcurrency(lambda broker: 4.0)  # bound 2 x 4 + 1 ms
    slots = concurrency.slots(1)
    slots.limit = 10.0
    for n in range(10):
        slots.acquire(f"t{n}", 1.0, f"w{n}", 0.0)
    slots.sample(1.0, 0.0, 9.0)  # opens the window
    concurrency.completed(1, "t0", None, 5.0, fetch=True)  # a Fetch answered: untimed, but counted
    assert slots.limit == 10.0
    window(slots, [30.0] * 5, 10.0, bound=9.0)
    assert slots.limit == 7.0
    limits = []
    for n in range(AVOIDANCE_WINDOWS + 1):  # healthy windows without Fetches
        window(slots, [3.0] * 5, (2 + 2 * n) * WINDOW_MS, bound=9.0)
        limits.append(slots.limit)
    stepped = 7.0 + AVOIDANCE_WINDOWS * AVOIDANCE_STEP
    assert limits[:-1] == [7.0 + (n + 1) * AVOIDANCE_STEP for n in range(AVOIDANCE_WINDOWS)]
    assert abs(limits[-1] - (stepped + stepped ** 0.5)) < 1e-9, "back to square-root growth"


def test_a_cut_without_fetches_or_after_a_connection_closed_grows_back_by_the_square_root() -> None:
    concurrency: BrokerConcurrency[str] = BrokerConcurrency(lambda broker: 4.0)
    slots = concurrency.slots(1)
    slots.limit = 10.0
    for n in range(10):
        slots.acquire(f"t{n}", 1.0, f"w{n}", 0.0)
    slots.sample(1.0, 0.0, 9.0)
    concurrency.completed(1, "t0", None, 5.0)  # never answered: not a Fetch's piece of work
    window(slots, [30.0] * 5, 10.0, bound=9.0)
    window(slots, [3.0] * 5, 2 * WINDOW_MS, bound=9.0)
    assert abs(slots.limit - (7.0 + 7.0 ** 0.5)) < 1e-9
    # a Fetch answered in a window that was not cut changes nothing either
    concurrency.completed(1, "t1", None, 3 * WINDOW_MS, fetch=True)
    before = slots.limit
    window(slots, [3.0] * 5, 4 * WINDOW_MS, bound=9.0)
    assert abs(slots.limit - (before + before ** 0.5)) < 1e-9


def test_no_baseline_or_too_few_samples_move_nothing() -> None:
    slots = limited(8)
    window(slots, [100.0] * 5, 0.0, bound=None)
    assert slots.limit == 8
    window(slots, [100.0, 100.0], 5 * WINDOW_MS, bound=9.0)
    assert slots.limit == 8


def test_the_limit_stays_between_its_bounds() -> None:
    slots = limited(MIN_LIMIT)
    window(slots, [50.0] * 5, 0.0, bound=9.0)
    assert slots.limit == MIN_LIMIT
    for n in range(40):
        window(slots, [1.0] * 5, (2 + 2 * n) * WINDOW_MS, bound=9.0)
    assert slots.limit == MAX_LIMIT


def test_a_raised_limit_wakes_waiters() -> None:
    concurrency: BrokerConcurrency[str] = BrokerConcurrency(lambda broker: 2.0)
    slots = concurrency.slots(1)
    slots.limit = MIN_LIMIT
    assert slots.acquire(SILVER, 1.0, "s1", 0.0)
    assert not slots.acquire(SILVER, 1.0, "s2", 0.0) and not slots.acquire(SILVER, 1.0, "s3", 0.0)
    for i in range(3):  # a healthy window's samples (bound 2 x 2 + 5 ms)
        assert slots.sample(1.0, float(i), concurrency.bound_ms(1)) is None
    woken, change = concurrency.completed(1, SILVER, 1.0, float(WINDOW_MS + 3))
    assert change is not None and change.old == MIN_LIMIT and change.new == 2.0
    assert woken == ["s2", "s3"] and slots.in_flight == 2


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["acquire", "release", "cancel"]),
                          st.sampled_from([GOLD, SILVER, BRONZE])), max_size=60),
       st.sampled_from([1.0, 2.0, 3.5]))
def test_counts_stay_true_and_the_limit_binds(ops: list[tuple[str, str]], limit: float) -> None:
    """Whatever the order: the counts add up, no waiter is woken twice or lost, a request goes
    only within its tenant's own slots or the limit, and nobody waits for nothing."""
    slots = limited(limit)
    weights = {GOLD: 10.0, SILVER: 1.0, BRONZE: 1.0}
    running: dict[str, int] = {t: 0 for t in weights}
    queued: dict[str, list[str]] = {t: [] for t in weights}
    seen: set[str] = set()
    for n, (op, tenant) in enumerate(ops):
        woken: list[str] = []
        if op == "acquire":
            waiter = f"{tenant}-{n}"
            before = slots.in_flight
            if slots.acquire(tenant, weights[tenant], waiter, float(n)):
                own = running[tenant] < slots.owned(tenant)  # its share as this request found it
                running[tenant] += 1
                # within its own slots, or within the limit, or the broker had nothing
                assert own or before == 0 or before + 1 <= limit
            else:
                queued[tenant].append(waiter)
        elif op == "release" and running[tenant]:
            running[tenant] -= 1
            woken = slots.release(tenant)
        elif op == "cancel" and queued[tenant]:
            slots.cancel(tenant, queued[tenant].pop(0))
        for waiter in woken:
            owner = waiter.split("-")[0]
            assert waiter not in seen
            seen.add(waiter)
            queued[owner].remove(waiter)
            running[owner] += 1
        assert slots.in_flight == sum(running.values())
        assert slots.waiting == sum(len(q) for q in queued.values())
        # nobody waits while the broker has nothing in flight, nor while it has slots of its own free
        assert not slots.waiting or slots.in_flight > 0
        assert all(running[t] >= slots.owned(t) for t in weights if queued[t])


class Slots:
    """A BrokerAdmission over one BrokerSlots, as proxy/capacity/broker_limits.py drives it."""

    def __init__(self, limit: float) -> None:
        self.slots = limited(limit)
        self.done_with: list[tuple[Hashable, float | None, bool]] = []
        self.woken: list[str] = []

    def admit(self, principal: str, client_id: str) -> Hashable | None:
        return client_id if self.slots.acquire(client_id, 1.0, client_id, 0.0) else None

    def done(self, ticket: Hashable, latency_ms: float | None, fetch: bool = False) -> None:
        self.done_with.append((ticket, latency_ms, fetch))
        self.woken += self.slots.release(ticket)

    def limited(self, principal: str, client_id: str) -> bool:
        return self.slots.limit < MAX_LIMIT


def test_a_produce_over_the_limit_waits_with_what_follows_and_goes_on_in_order() -> None:
    admission = Slots(1)
    assert admission.slots.acquire("test-client", 1.0, "another connection's", 0.0)
    conn = ProxyConnection(advertise, admission=admission)
    actions = conn.receive_from_client(framed(produce_request(1, 9, acks=-1), produce_request(2, 9, acks=-1)),
                                       10.0)
    assert of_type(actions, AwaitSlot) and broker_frames(actions) == []
    assert conn.awaiting_slot and conn.waiting_requests
    # more arriving meanwhile waits behind them, and resume (a mute's end) does not let them go
    assert conn.receive_from_client(framed(produce_request(3, 9, acks=0)), 11.0) == []
    assert conn.resume(12.0) == []
    assert admission.slots.release("test-client") == ["test-client"]  # this connection's turn
    actions = conn.slot_granted("test-client", 20.0)
    # request 1 takes the granted slot; request 2 finds the broker's one slot in flight again
    assert [parse_request_header(f).correlation_id for f in broker_frames(actions)] == [1]
    assert of_type(actions, AwaitSlot) and conn.awaiting_slot
    actions = conn.receive_from_broker(framed(produce_response(1, 9)), 35.0)
    assert admission.done_with == [("test-client", 15.0, False)]
    assert admission.woken == [conn.client_id]  # the waiter: the connection's own request 2
    actions = conn.slot_granted("test-client", 36.0)
    # request 2 takes the slot; request 3 (acks=0) takes none
    assert [parse_request_header(f).correlation_id for f in broker_frames(actions)] == [2, 3]
    assert conn.release_slots() == ["test-client"]
    assert not conn.awaiting_slot


def test_a_grant_nobody_waits_for_is_given_back() -> None:
    admission = Slots(1)
    conn = ProxyConnection(advertise, admission=admission)
    assert conn.slot_granted("test-client", 1.0) == []
    assert admission.done_with == [("test-client", None, False)]


def _catching_up(conn: ProxyConnection, admission: Slots, size: int = CATCHING_UP_BYTES) -> None:
    """A first Fetch (caught up as far as the connection knows: no slot) answered with `size` of records."""
    before, done = admission.slots.in_flight, len(admission.done_with)
    actions = conn.receive_from_client(fetch_request(1, "test-client"), 1.0)
    assert len(broker_frames(actions)) == 1 and admission.slots.in_flight == before
    conn.receive_from_broker(framed(fetch_response(1, b"r" * size)), 2.0)
    assert len(admission.done_with) == done


def test_a_catching_up_consumer_fetch_takes_a_slot_asks_for_less_and_its_time_judges_nothing() -> None:
    admission = Slots(1)
    conn = ProxyConnection(advertise, admission=admission)
    _catching_up(conn, admission)  # fed whole, so answered as one frame, not streamed
    # its last answer brought records: the next Fetch takes the broker's one slot, capped in size
    actions = conn.receive_from_client(fetch_request(2, "test-client"), 3.0)
    [sent] = broker_frames(actions)
    assert admission.slots.in_flight == 1
    assert decode_request(sent).max_bytes == FETCH_BYTES_WHILE_LIMITED
    # another connection's catching-up Fetch waits for it
    other = ProxyConnection(advertise, admission=admission)
    _catching_up(other, admission)
    assert of_type(other.receive_from_client(fetch_request(2, "test-client"), 3.5), AwaitSlot)
    conn.receive_from_broker(framed(fetch_response(2, b"")), 9.0)
    assert admission.done_with == [("test-client", None, True)], "a Fetch told as a Produce or timed"
    assert admission.woken == ["test-client"]
    # that answer was empty: the consumer is caught up, and its next long poll holds no slot
    conn.receive_from_client(fetch_request(3, "test-client"), 10.0)
    assert admission.slots.in_flight == 1  # the other connection's, granted


def test_a_fetch_asks_for_its_own_size_while_the_limit_is_at_its_maximum() -> None:
    admission = Slots(MAX_LIMIT)
    conn = ProxyConnection(advertise, admission=admission)
    _catching_up(conn, admission)
    [sent] = broker_frames(conn.receive_from_client(fetch_request(2, "test-client"), 3.0))
    assert decode_request(sent).max_bytes == 50_000_000
    assert admission.slots.in_flight == 1  # counted all the same, so a cut finds it


def test_a_streamed_fetch_holds_its_slot_until_its_last_byte_or_its_connection_closes() -> None:
    admission = Slots(1)
    conn = ProxyConnection(advertise, admission=admission)
    _catching_up(conn, admission, size=3 * STREAM_MIN_BYTES)
    conn.receive_from_client(fetch_request(2, "test-client"), 3.0)
    big = framed(fetch_response(2, b"r" * (3 * STREAM_MIN_BYTES)))
    assert to_client(conn.receive_from_broker(big[:STREAM_MIN_BYTES], 4.0))  # streaming has begun
    assert admission.done_with == [] and admission.slots.in_flight == 1
    assert to_client(conn.receive_from_broker(big[STREAM_MIN_BYTES:], 5.0))
    assert admission.done_with == [("test-client", None, True)]
    # the next one streams too, and the client leaves in the middle of it: its slot goes back
    conn.receive_from_client(fetch_request(3, "test-client"), 6.0)
    big = framed(fetch_response(3, b"r" * (3 * STREAM_MIN_BYTES)))
    conn.receive_from_broker(big[:STREAM_MIN_BYTES], 7.0)
    assert conn.release_slots() == ["test-client"]
