"""The fleet's pure half (issue 11): the usage datagram, peers' merged usage, what to send, and
three engines exchanging reports through the codec while greedy producers of one client id push.

Names: a *member* is one proxy (one QuotaEngine with its PeerUsage); *peers* are the others.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import itertools
import random
import struct
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quotas.engine import EngineConfig, QuotaEngine
from quotas.entity import DEFAULT, QuotaEntity
from quotas.fleet import (
    DEFAULT_STALE_AFTER_MS,
    MAX_CLOCK_SKEW_MS,
    MAX_DATAGRAM_BYTES,
    MAX_FLEET_NAME_BYTES,
    SENDER_RETENTION_MS,
    URGENT_MIN_INTERVAL_MS,
    DatagramRejected,
    PeerUsage,
    UsageEntry,
    UsageReport,
    UsageTracker,
    decode_usage,
    encode_usage,
    wire_name,
)
from quotas.rate import WindowConfig
from quotas.types import QuotaType
from tests.integration.quota_runs import slope

P, F, R, PIDS = QuotaType.PRODUCE, QuotaType.FETCH, QuotaType.REQUEST, QuotaType.PRODUCER_IDS
SECRET = b"fleet-secret-0123456789abcdef-32"
FLEET = "lkc-7xq2mv0k3bTQ2mCJ0Kg"  # a cluster id, the default fleet name
NOW = 1_700_000_000_000
PROPS = settings(max_examples=200, derandomize=True, deadline=None, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def f32(x: float) -> float:
    return float(struct.unpack("!f", struct.pack("!f", x))[0])


def one(entries: list[UsageEntry], pids: list[tuple[str, int]] | None = None, *, sender: int = 7,
        seq: int = 1, sent: int = NOW, full: bool = False, fleet: str = FLEET) -> bytes:
    datagrams = encode_usage(fleet, sender, seq, sent, full, entries, pids or [], SECRET)
    assert len(datagrams) == 1
    return datagrams[0]


def signed(body: bytes, secret: bytes = SECRET) -> bytes:
    return body + hmac.new(secret, body, hashlib.sha256).digest()


def reason(datagram: object, **kw: object) -> str:
    args: dict[str, object] = {"secret": SECRET, "fleet": FLEET, "now_unix_ms": NOW, **kw}
    with pytest.raises(DatagramRejected) as caught:
        decode_usage(datagram, **args)  # type: ignore[arg-type]
    return caught.value.reason


# -- the codec ---------------------------------------------------------------------------------

names = st.one_of(
    st.text(max_size=40),
    st.text(max_size=400),
    st.sampled_from(["", "ANONYMOUS", "x" * 254, "x" * 255, "\u00e9" * 127, "\u00e9" * 128,
                     "CN=kafka%2Cclient,OU=x" * 20]),
)
entries_st = st.lists(st.builds(UsageEntry, st.sampled_from(list(QuotaType)), names, names,
                                st.floats(0.0, 1e15, allow_nan=False)), max_size=400)
pids_st = st.lists(st.tuples(names, st.integers(-(2**63), 2**63 - 1)), max_size=150)


@PROPS
@given(entries=entries_st, pids=pids_st, full=st.booleans(), sender=st.integers(0, 2**64 - 1),
       first_seq=st.integers(0, 2**63))
def test_round_trip(entries: list[UsageEntry], pids: list[tuple[str, int]], full: bool, sender: int,
                    first_seq: int) -> None:
    datagrams = encode_usage(FLEET, sender, first_seq, NOW, full, entries, pids, SECRET)
    assert datagrams and all(len(d) <= MAX_DATAGRAM_BYTES for d in datagrams)
    reports = [decode_usage(d, SECRET, FLEET, NOW) for d in datagrams]
    assert [r.seq for r in reports] == list(range(first_seq, first_seq + len(datagrams)))
    assert all((r.fleet, r.sender, r.sent_unix_ms, r.full) == (FLEET, sender, NOW, full) for r in reports)
    grouped: dict[tuple[str, str], list[UsageEntry]] = {}  # a bucket's entries travel together
    for e in entries:
        grouped.setdefault((e.user, e.client_id), []).append(e)
    assert [e for r in reports for e in r.entries] == [
        UsageEntry(e.quota, wire_name(e.user), wire_name(e.client_id), f32(e.rate))
        for same in grouped.values() for e in same]
    assert [p for r in reports for p in r.new_producer_ids] == [(wire_name(u), pid) for u, pid in pids]


def test_nothing_to_send_is_one_empty_datagram_a_heartbeat() -> None:
    report = decode_usage(one([]), SECRET, FLEET, NOW)
    assert (report.entries, report.new_producer_ids, report.seq) == ((), (), 1)


def test_ten_thousand_entities_pack_at_under_fifteen_bytes_an_entry() -> None:
    """Two quota types per client id, one user: the string table carries each name once a datagram."""
    entries = [UsageEntry(q, "ANONYMOUS", f"client-{i:05d}", 1234.5 + i)
               for i in range(10_000) for q in (P, R)]
    datagrams = encode_usage(FLEET, 1, 1, NOW, True, entries, [], SECRET)
    sizes = [len(d) for d in datagrams]
    assert max(sizes) <= MAX_DATAGRAM_BYTES
    assert min(sizes[:-1]) >= MAX_DATAGRAM_BYTES - 30  # filled, not split early
    assert sum(sizes) / len(entries) < 15.0, sum(sizes) / len(entries)


def test_datagrams_stay_bounded_when_every_name_is_distinct_and_as_long_as_a_literal_can_be() -> None:
    entries = [UsageEntry(P, f"{i:04d}" + "u" * 250, f"{i:04d}" + "c" * 250, 1.0) for i in range(50)]
    datagrams = encode_usage(FLEET, 1, 1, NOW, False, entries, [], SECRET)
    assert len(datagrams) == 25  # two such entries (2 x 517 bytes) a datagram
    assert all(len(d) <= MAX_DATAGRAM_BYTES for d in datagrams)
    # the longest fleet name leaves room for one: still never more than the bound
    datagrams = encode_usage("f" * MAX_FLEET_NAME_BYTES, 1, 1, NOW, False, entries, [], SECRET)
    assert len(datagrams) == 50 and all(len(d) <= MAX_DATAGRAM_BYTES for d in datagrams)


def test_a_name_too_long_for_a_datagram_travels_as_a_digest_and_is_still_enforced() -> None:
    """Decided: never refused, never truncated into another name. A name over 254 UTF-8 bytes is
    sent as a 16-byte SHA-256 prefix and keyed by `wire_name`, which no literal name can equal."""
    long_user, long_client = "u" * 40_000, "\u00e9" * 200  # 400 UTF-8 bytes
    datagram = one([UsageEntry(P, long_user, long_client, 5.0)], [(long_user, 42)])
    assert len(datagram) < 200
    report = decode_usage(datagram, SECRET, FLEET, NOW)
    (entry,) = report.entries
    assert (entry.user, entry.client_id) == (wire_name(long_user), wire_name(long_client))
    assert report.new_producer_ids == ((wire_name(long_user), 42),)
    assert len(entry.user) == 255 and len(entry.user.encode()) == 255  # longer than any literal
    peers = PeerUsage(quota_window_ms=11_000)
    peers.accept(report, 0)
    assert peers.peer_rate(P, long_user, long_client, 0) == 5.0
    assert peers.peer_rate(P, "u" * 39_999 + "v", long_client, 0) == 0.0
    assert peers.peer_rate(P, "ANONYMOUS", "app", 0) == 0.0


def test_wire_names() -> None:
    assert wire_name("x" * 254) == "x" * 254
    assert wire_name("\u00e9" * 127) == "\u00e9" * 127  # 254 bytes
    assert wire_name("x" * 255) != wire_name("x" * 256)
    assert len(wire_name("\u00e9" * 128)) == 255
    assert wire_name("\ud800") != wire_name("\ud801")  # not UTF-8 encodable: hashed, never a crash
    report = decode_usage(one([UsageEntry(P, "\ud800", "", 1.0)]), SECRET, FLEET, NOW)
    assert report.entries[0].user == wire_name("\ud800")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"fleet": "f" * (MAX_FLEET_NAME_BYTES + 1)}, "fleet name is 250 bytes"),
    ({"secret": b"short"}, "fleet secret is 5 bytes"),
    ({"sender": -1}, "sender must be in 0..2**64-1, got -1"),
    ({"first_seq": 2**64}, "first_seq"),
    ({"entries": [UsageEntry(P, "u", "c", float("nan"))]}, "rate of"),
    ({"entries": [UsageEntry(P, "u", "c", float("inf"))]}, "rate of"),
    ({"entries": [UsageEntry(P, "u", "c", 1e39)]}, "rate of"),
    ({"new_producer_ids": [("u", 2**63)]}, "producer id 9223372036854775808"),
])
def test_encode_refuses_bad_arguments_naming_them(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"fleet": FLEET, "sender": 1, "first_seq": 1, "sent_unix_ms": NOW,
                               "full": False, "entries": [], "new_producer_ids": [], "secret": SECRET}
    args.update(kwargs)
    with pytest.raises(ValueError, match=message.replace("*", r"\*").replace(".", r"\.")):
        encode_usage(**args)  # type: ignore[arg-type]


def test_a_negative_rate_rounding_remainder_is_sent_as_zero() -> None:
    report = decode_usage(one([UsageEntry(P, "u", "c", -1e-9)]), SECRET, FLEET, NOW)
    assert report.entries[0].rate == 0.0


# -- what decode refuses -----------------------------------------------------------------------

REASONS = {"malformed", "bad_mac", "replayed", "stale", "other_fleet"}
VALID = one([UsageEntry(P, "ANONYMOUS", "etl", 2.5e6), UsageEntry(R, "", "etl", 12.0)], [("ANONYMOUS", 9)])


@PROPS
@given(st.binary(max_size=1500))
def test_random_bytes_are_rejected(data: bytes) -> None:
    assert reason(data) in {"malformed", "bad_mac"}


@PROPS
@given(st.binary(max_size=MAX_DATAGRAM_BYTES - 32))
def test_signed_garbage_is_rejected_or_parsed_never_raises_anything_else(body: bytes) -> None:
    """Even with the right MAC (a member with a bug, or a leaked secret), the parser only ever
    returns a report or raises DatagramRejected."""
    try:
        decode_usage(signed(b"\x01" + body), SECRET, FLEET, NOW)
    except DatagramRejected as e:
        assert e.reason in REASONS


@PROPS
@given(st.data())
def test_signed_mutations_of_a_valid_datagram_never_raise_anything_else(data: st.DataObject) -> None:
    body = bytearray(VALID[:-32])
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(body) - 1))
        action = data.draw(st.sampled_from(["set", "insert", "delete"]))
        if action == "set":
            body[at] = data.draw(st.integers(0, 255))
        elif action == "insert":
            body[at:at] = data.draw(st.binary(min_size=1, max_size=8))
        elif len(body) > 1:
            del body[at]
    try:
        report = decode_usage(signed(bytes(body)), SECRET, FLEET, NOW)
    except DatagramRejected as e:
        assert e.reason in REASONS
    else:
        assert all(e.rate >= 0.0 for e in report.entries)


@PROPS
@given(st.integers(0, len(VALID) - 1))
def test_truncated_datagrams_are_rejected(size: int) -> None:
    assert reason(VALID[:size]) in {"malformed", "bad_mac"}


@PROPS
@given(st.integers(0, len(VALID) * 8 - 1))
def test_any_flipped_bit_is_rejected(bit: int) -> None:
    flipped = bytearray(VALID)
    flipped[bit // 8] ^= 1 << (bit % 8)
    assert reason(bytes(flipped)) == ("malformed" if bit < 8 else "bad_mac")  # byte 0: the version


@PROPS
@given(st.binary(min_size=1, max_size=64).filter(lambda s: s != SECRET))
def test_a_wrong_secret_is_a_bad_mac(secret: bytes) -> None:
    assert reason(VALID, secret=secret) == "bad_mac"


def test_other_fleet_old_and_future_datagrams_are_rejected() -> None:
    assert reason(one([], fleet="lkc-other")) == "other_fleet"
    decode_usage(VALID, SECRET, FLEET, NOW + MAX_CLOCK_SKEW_MS)  # at the bound: accepted
    decode_usage(VALID, SECRET, FLEET, NOW - MAX_CLOCK_SKEW_MS)
    assert reason(VALID, now_unix_ms=NOW + MAX_CLOCK_SKEW_MS + 1) == "stale"
    assert reason(VALID, now_unix_ms=NOW - MAX_CLOCK_SKEW_MS - 1) == "stale"


@pytest.mark.parametrize(("body", "detail"), [
    (b"\x01\x02\x00" + bytes(24) + b"\x00" + bytes(4), "unknown flags"),
    (b"\x01\x00\xf0abc" + bytes(40), "fleet name runs past"),
    (b"\x01\x00\x00" + struct.pack("!QQQ", 1, 1, NOW) + b"\x01\x20ab" + bytes(4), "a name runs past"),
    (b"\x01\x00\x00" + struct.pack("!QQQ", 1, 1, NOW) + b"\x01\xffab" + bytes(4), "digest runs past"),
    (b"\x01\x00\x00" + struct.pack("!QQQ", 1, 1, NOW) + b"\x01\x02\xff\xfe" + bytes(4), "UnicodeDecodeError"),
    (b"\x01\x00\x00" + struct.pack("!QQQ", 1, 1, NOW) + b"\x01\x01u\x00\x01\x00\x00\x05" +
     struct.pack("!f", 1.0) + bytes(2), "IndexError"),
    (b"\x01\x00\x00" + struct.pack("!QQQ", 1, 1, NOW) + b"\x01\x01u\x00\x01\x63\x00\x00" +
     struct.pack("!f", 1.0) + bytes(2), "unknown quota code 99"),
    (b"\x01\x00\x00" + struct.pack("!QQQ", 1, 1, NOW) + b"\x01\x01u\x00\x01\x00\x00\x00" +
     struct.pack("!f", float("nan")) + bytes(2), "rate nan"),
    (b"\x01\x00\x00" + struct.pack("!QQQ", 1, 1, NOW) + b"\x01\x01u\x00\x01\x00\x00\x00" +
     struct.pack("!f", -2.0) + bytes(2), "rate -2"),
    (b"\x01\x00\x00" + struct.pack("!QQQ", 1, 1, NOW) + b"\x00\x00\x09" + bytes(2), "9 entries run past"),
    (b"\x01\x00\x00" + struct.pack("!QQQ", 1, 1, NOW) + b"\x00" + bytes(4) + b"x",
     "0 producer ids and 1 bytes"),
])
def test_signed_but_malformed_bodies_name_what_is_wrong(body: bytes, detail: str) -> None:
    with pytest.raises(DatagramRejected, match=detail) as caught:
        decode_usage(signed(body), SECRET, "", NOW)
    assert caught.value.reason == "malformed"


def test_things_that_are_not_datagrams_are_malformed() -> None:
    assert reason("a string") == "malformed"
    assert reason(None) == "malformed"
    assert reason(VALID + bytes(MAX_DATAGRAM_BYTES)) == "malformed"
    assert reason(b"\x02" + VALID[1:]) == "malformed"
    assert decode_usage(memoryview(VALID), SECRET, FLEET, NOW).seq == 1


# -- PeerUsage: replay, merge, ageing ------------------------------------------------------------

def report(sender: int, seq: int, *entries: tuple[QuotaType, str, str, float],
           pids: tuple[tuple[str, int], ...] = ()) -> UsageReport:
    return UsageReport(FLEET, sender, seq, NOW, False, tuple(UsageEntry(*e) for e in entries), pids)


def test_a_replayed_or_older_sequence_number_is_rejected_per_sender() -> None:
    peers = PeerUsage(quota_window_ms=11_000)
    peers.accept(report(1, 5, (P, "u", "c", 100.0)), 0)
    for seq in (5, 4, 0):
        with pytest.raises(DatagramRejected) as caught:
            peers.accept(report(1, seq, (P, "u", "c", 999.0)), 10)
        assert caught.value.reason == "replayed"
    peers.accept(report(2, 1, (P, "u", "c", 50.0)), 10)  # another sender has its own sequence
    peers.accept(report(1, 6, (P, "u", "c", 120.0)), 20)
    assert peers.peer_rate(P, "u", "c", 20) == 170.0


def test_a_replay_through_the_codec_is_rejected() -> None:
    peers = PeerUsage(quota_window_ms=11_000)
    peers.accept(decode_usage(VALID, SECRET, FLEET, NOW), 0)
    with pytest.raises(DatagramRejected, match="replayed"):
        peers.accept(decode_usage(VALID, SECRET, FLEET, NOW + 1), 1)


def test_peers_rates_are_summed_per_bucket_and_quota_absolute_not_added_up() -> None:
    peers = PeerUsage(quota_window_ms=11_000)
    peers.accept(report(1, 1, (P, "u", "c", 100.0), (F, "u", "c", 7.0), (P, "u", "", 1.0)), 0)
    peers.accept(report(2, 1, (P, "u", "c", 30.0)), 0)
    peers.accept(report(1, 2, (P, "u", "c", 60.0)), 5)  # replaces sender 1's 100
    assert peers.peer_rate(P, "u", "c", 5) == 90.0
    assert peers.peer_rate(F, "u", "c", 5) == 7.0
    assert peers.peer_rate(P, "u", "", 5) == 1.0
    assert peers.peer_rate(R, "u", "c", 5) == 0.0
    assert peers.view(P).rates(5) == {("u", "c"): 90.0, ("u", ""): 1.0}
    assert peers.sender_rates(P, "u", "c", 5) == {1: 60.0, 2: 30.0}
    assert len(peers) == 4


def test_a_zero_rate_removes_the_entry_at_once() -> None:
    peers = PeerUsage(quota_window_ms=11_000)
    peers.accept(report(1, 1, (P, "u", "c", 100.0)), 0)
    peers.accept(report(1, 2, (P, "u", "c", 0.0)), 1)
    assert (peers.peer_rate(P, "u", "c", 1), len(peers)) == (0.0, 0)


def test_own_datagrams_are_ignored() -> None:
    peers = PeerUsage(quota_window_ms=11_000, own_sender=3)
    peers.accept(report(3, 1, (P, "u", "c", 100.0)), 0)
    assert (peers.peer_rate(P, "u", "c", 0), peers.members(0)) == (0.0, {})


def test_ageing_full_weight_until_stale_then_linear_to_zero_over_one_window() -> None:
    window = 11_000
    peers = PeerUsage(quota_window_ms=window)
    peers.accept(report(1, 1, (P, "u", "c", 1100.0)), 0)
    rate = [peers.peer_rate(P, "u", "c", t) for t in range(0, 16_001)]
    assert rate[0] == rate[DEFAULT_STALE_AFTER_MS] == 1100.0
    assert rate[DEFAULT_STALE_AFTER_MS + 1] == pytest.approx(1100.0 * (1 - 1 / window))
    assert rate[DEFAULT_STALE_AFTER_MS + window // 2] == pytest.approx(550.0)
    assert rate[DEFAULT_STALE_AFTER_MS + window] == 0.0 == rate[16_000]
    steps = [a - b for a, b in itertools.pairwise(rate)]
    assert min(steps) >= 0.0  # never rises
    assert max(steps) <= 1100.0 / window + 1e-9  # never a step: at most the linear slope per ms


def test_a_fresh_report_restores_full_weight_and_expiry_waits_for_zero_weight() -> None:
    peers = PeerUsage(quota_window_ms=11_000)
    peers.accept(report(1, 1, (P, "u", "c", 1100.0), (F, "u", "c", 5.0)), 0)
    peers.accept(report(1, 2, (P, "u", "c", 1000.0)), 8000)
    assert peers.peer_rate(P, "u", "c", 8000) == 1000.0
    assert peers.peer_rate(F, "u", "c", 8000) == pytest.approx(5.0 * (1 - 5000 / 11_000))
    assert peers.expire(13_999) == 0
    assert peers.expire(14_000) == 1  # the fetch entry reached 0
    assert len(peers) == 1
    assert peers.peer_rate(P, "u", "c", 14_000) == pytest.approx(1000.0 * (1 - 3000 / 11_000))
    assert peers.expire(22_000) == 1 and len(peers) == 0


def test_members_report_staleness_and_a_silent_sender_is_forgotten_after_retention() -> None:
    peers = PeerUsage(quota_window_ms=3000)
    peers.accept(report(1, 1, (P, "u", "c", 10.0)), 0)
    peers.accept(report(2, 1), 500)
    assert peers.members(1000) == {1: 1000, 2: 500}
    peers.expire(6000)  # sender 1's entry aged out; both senders still remembered (replays)
    assert len(peers) == 0 and peers.members(6000) == {1: 6000, 2: 5500}
    peers.expire(SENDER_RETENTION_MS + 500)
    assert peers.members(SENDER_RETENTION_MS + 500) == {}
    peers.accept(report(1, 1, (P, "u", "c", 10.0)), SENDER_RETENTION_MS + 500)  # a new start


def test_expiry_work_is_bounded() -> None:
    peers = PeerUsage(quota_window_ms=1000)
    peers.accept(report(1, 1, *((P, "u", f"c{i}", 1.0) for i in range(100))), 0)
    assert peers.expire(10_000, budget=30) == 30 and len(peers) == 70


def test_max_entries_evicts_the_least_recently_updated() -> None:
    peers = PeerUsage(quota_window_ms=11_000, max_entries=3)
    peers.accept(report(1, 1, (P, "u", "a", 1.0), (P, "u", "b", 2.0)), 0)
    peers.accept(report(2, 1, (P, "u", "c", 3.0)), 10)
    peers.accept(report(1, 2, (P, "u", "a", 1.5)), 20)  # "a" is now the most recent of sender 1
    peers.accept(report(2, 2, (P, "u", "d", 4.0)), 30)
    assert len(peers) == 3 and peers.evicted == 1
    assert peers.peer_rate(P, "u", "b", 30) == 0.0
    assert [peers.peer_rate(P, "u", k, 30) for k in "acd"] == [1.5, 3.0, 4.0]


def test_constructor_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="quota_window_ms"):
        PeerUsage(quota_window_ms=0)
    with pytest.raises(ValueError, match="max_entries"):
        PeerUsage(quota_window_ms=1, max_entries=0)
    with pytest.raises(ValueError, match="change_ratio"):
        UsageTracker(change_ratio=1.5)


# -- UsageTracker ------------------------------------------------------------------------------

def entry(rate: float, client: str = "c", quota: QuotaType = P) -> UsageEntry:
    return UsageEntry(quota, "u", client, rate)


def test_tracker_sends_changes_over_one_percent_of_what_was_last_sent() -> None:
    tracker = UsageTracker()
    assert tracker.due([entry(100.0), entry(5.0, "d")], full=False) == [entry(100.0), entry(5.0, "d")]
    assert tracker.due([entry(100.9), entry(5.0, "d")], full=False) == []
    assert tracker.due([entry(101.0)], full=False) == []  # exactly 1 %: not more
    assert tracker.due([entry(101.1)], full=False) == [entry(101.1)]  # drift accumulates
    assert tracker.due([entry(100.2)], full=False) == []  # within 1 % of 101.1
    assert tracker.due([entry(99.0)], full=False) == [entry(99.0)]
    assert tracker.due([entry(0.0)], full=False) == [entry(0.0)]  # went to 0: once
    assert tracker.due([entry(0.0)], full=False) == []
    assert tracker.due([entry(0.0, "new")], full=False) == []  # nothing peers need to learn


def test_tracker_full_sync_sends_everything_and_zeroes_what_disappeared() -> None:
    tracker = UsageTracker()
    tracker.due([entry(100.0), entry(5.0, "d"), entry(3.0, "e")], full=False)
    tracker.due([entry(0.0, "e")], full=False)
    assert tracker.due([entry(100.0), entry(0.0, "e")], full=True) == [entry(100.0), entry(0.0, "d")]
    assert len(tracker) == 2  # "d" forgotten; "e" kept at 0 while its bucket lives
    assert tracker.due([entry(100.0)], full=True) == [entry(100.0)]
    assert len(tracker) == 1


# -- the engine hook ---------------------------------------------------------------------------

QUOTA = 2_500_000.0
CLIENT = QuotaEntity(None, "c")


def fleet_engine(sender: int = 1) -> tuple[QuotaEngine, PeerUsage]:
    window = WindowConfig(3, 1000)
    engine = QuotaEngine(EngineConfig(window=window))
    engine.set_quotas({CLIENT: {P: QUOTA}})
    peers = PeerUsage(window.history_ms, own_sender=sender)
    engine.attach_fleet(peers)
    return engine, peers


def test_the_decision_uses_local_plus_peers_with_kafkas_formula() -> None:
    """Kafka's vector (500 B/s, ten 400 B records a second apart, then 2300 B: 2100 ms), with the
    usage split between this member and a peer: the same throttle as one broker would give."""
    engine = QuotaEngine()
    engine.set_quotas({QuotaEntity(None, "<default>"): {P: 500}})
    peers = PeerUsage(engine.config.window.history_ms)
    engine.attach_fleet(peers)
    for t in range(0, 10_000, 1000):
        assert engine.charge("ANONYMOUS", "unknown", t, produce_bytes=200).throttle_ms == 0
    # the peer's rate for the same bucket: another 200 B a second over the same padded 10 s window
    peers.accept(report(2, 1, (P, "", "unknown", 2000 / 10.5)), 10_500)  # client-id level: ("", c)
    verdict = engine.charge("ANONYMOUS", "unknown", 10_500, produce_bytes=2300)
    assert (verdict.throttle_ms, verdict.quota) == (2100, P)


def test_local_usage_lists_every_live_bucket_or_what_moved_among_those_charged_or_throttled() -> None:
    engine, _ = fleet_engine()
    engine.set_quotas({CLIENT: {P: QUOTA, R: 50.0}, QuotaEntity(None, "d"): {P: 400.0}})
    engine.charge("u", "c", 0, produce_bytes=3000, request_time_ms=10)
    assert engine.charge("u", "d", 0, produce_bytes=1000).throttle_ms == 500  # 500 B/s against 400

    def listed(now: int, changed_only: bool = True) -> list[tuple[str, str, float]]:
        return sorted((e.quota.name, e.client_id, round(e.rate, 2))
                      for e in engine.local_usage(now, changed_only=changed_only))

    full = [("PRODUCE", "c", 1304.35), ("PRODUCE", "d", 434.78), ("REQUEST", "c", 0.43)]
    assert listed(300, changed_only=False) == full  # over the padded 2.3 s window
    assert listed(400) == [("PRODUCE", "d", 416.67)]  # throttled: paused, so its rate falls
    engine.charge("u", "c", 450, produce_bytes=100)  # charged, but moved by < 1 % of its bound
    assert listed(600) == [("PRODUCE", "d", 384.62)]  # its throttle ended since the last listing
    engine.charge("u", "c", 700, produce_bytes=100_000)
    assert listed(800) == [("PRODUCE", "c", 36821.43)]  # "d" is left to the next full listing
    assert listed(900, changed_only=False) == [
        ("PRODUCE", "c", 35551.72), ("PRODUCE", "d", 344.83), ("REQUEST", "c", 0.34)]


def test_an_urgent_report_is_asked_for_once_when_a_bucket_rose_by_a_twentieth_of_its_bound() -> None:
    calls: list[int] = []
    engine = QuotaEngine(EngineConfig(window=WindowConfig(3, 1000)))
    engine.set_quotas({CLIENT: {P: 1000.0}, QuotaEntity(None, "d"): {P: 1000.0}})
    engine.attach_fleet(PeerUsage(3000), on_urgent=lambda: calls.append(1))
    engine.charge("u", "c", 0, produce_bytes=100)  # 50 B/s over the padded 2 s: exactly 5 %
    engine.charge("u", "d", 0, produce_bytes=30)  # 15 B/s: more than 1 % of its bound
    assert calls == []
    engine.charge("u", "c", 0, produce_bytes=2)
    engine.charge("u", "c", 0, produce_bytes=200)
    assert calls == [1]
    # an urgent report sends only the buckets that asked, "d" waits for the next sync
    assert engine.urgent_usage(0) == [UsageEntry(P, "", "c", 151.0)]
    assert engine.urgent_usage(0) == []
    engine.charge("u", "c", 0, produce_bytes=98)  # 200 B/s: 49 over what was listed
    assert calls == [1]
    engine.charge("u", "c", 0, produce_bytes=4)
    assert calls == [1, 1]
    assert sorted(e.client_id for e in engine.local_usage(0, changed_only=True)) == ["c", "d"]
    engine.charge("u", "c", 0, produce_bytes=101)
    assert calls == [1, 1, 1]  # listed by the delta sync: asks again past 5 % more


def test_producer_ids_are_counted_once_across_the_fleet() -> None:
    engines = []
    for sender in (1, 2):
        engine = QuotaEngine()
        engine.set_quotas({QuotaEntity("alice", None): {PIDS: 1000.0}})
        engine.attach_fleet(PeerUsage(engine.config.window.history_ms, own_sender=sender))
        engines.append(engine)
    a, b = engines
    a.charge("alice", "x", 0, producer_ids=[7, 8])
    a.charge("alice", "x", 1, producer_ids=[8, 9])
    assert a.take_new_producer_ids() == [("alice", 7), ("alice", 8), ("alice", 9)]
    assert a.take_new_producer_ids() == []
    b.learn_producer_ids("alice", [7, 8, 9], 2)
    b.charge("alice", "x", 3, producer_ids=[7, 8, 9, 10])
    assert b.take_new_producer_ids() == [("alice", 10)]
    assert b.managers[PIDS].buckets[("alice", "")].rate.total(3) == 1.0  # only 10 counted here


def test_without_a_fleet_nothing_is_collected() -> None:
    engine = QuotaEngine()
    engine.set_quotas({QuotaEntity("alice", None): {PIDS: 1000.0}, CLIENT: {P: 10.0}})
    engine.charge("alice", "c", 0, producer_ids=[7], produce_bytes=10_000)
    assert engine.take_new_producer_ids() == []
    assert engine.fleet is None
    assert not engine.managers[P]._charged


# -- three members, three greedy producers of one client id ---------------------------------------

SYNC_MS, FULL_SYNC_MS = 100, 1000
EPOCH = NOW


@dataclass
class Member:
    engine: QuotaEngine
    peers: PeerUsage
    sender: int
    tracker: UsageTracker = field(default_factory=UsageTracker)
    seq: int = 1
    urgent_at: float = -1e9
    urgent_pending: bool = False


@dataclass
class Run:
    #: (time since start, bytes, member) for every produce request
    delivered: list[tuple[float, int, int]]
    #: (time since start, the dead member's rate as member 0 weighs it), every sync of member 0
    dead_rate: list[tuple[float, float]]
    #: datagrams dropped because a later one from the same member arrived first
    rejected: int


def replay_fleet(seed: int, *, fleet: bool = True, drop: float = 0.0, until_ms: float = 30_000,
                 die: tuple[int, float] | None = None, size: int = 256_000) -> Run:
    """Three members, each with a greedy producer on three connections (as in
    test_quota_dynamics.py: each connection sends again as soon as its answer is back and its
    throttle and hold have passed). Members exchange reports as the proxy does: every 100 ms the
    buckets that changed, every second all of them, and an urgent report (at most every 10 ms)
    when the hot path asks; each datagram goes through encode_usage/decode_usage, arrives 0.2-2 ms
    later, and with `drop` some are lost. `die=(member, at_ms)`: that member and its producer stop.
    """
    rng = random.Random(seed)
    window = WindowConfig(3, 1000)
    events: list[tuple[float, int, int, int, bytes]] = []  # time, kind, member, n, datagram
    members = []
    for n in range(3):
        engine = QuotaEngine(EngineConfig(window=window))
        engine.set_quotas({CLIENT: {P: QUOTA}})
        peers = PeerUsage(window.history_ms, own_sender=n + 1)
        member = Member(engine, peers, n + 1)
        if fleet:
            def urgent(member: Member = member) -> None:
                member.urgent_pending = True
            engine.attach_fleet(peers, on_urgent=urgent)
        members.append(member)
    start = rng.uniform(0, 1000)
    for n in range(3):
        for _ in range(3):
            heapq.heappush(events, (start + rng.uniform(0, 5), 0, n, 0, b""))
        if fleet:
            heapq.heappush(events, (rng.uniform(0, SYNC_MS), 1, n, 0, b""))
    delivered: list[tuple[float, int, int]] = []
    dead_rate: list[tuple[float, float]] = []
    rejected = 0
    while events:
        now, kind, n, count, datagram = heapq.heappop(events)
        if now > start + until_ms:
            break
        if die is not None and n == die[0] and now - start >= die[1]:
            continue
        member = members[n]
        engine = member.engine
        t = int(now)
        if kind == 0:  # a connection of member n's producer
            hold = engine.hold_ms("", "c", 0, t)
            if hold > 0:
                heapq.heappush(events, (now + hold, 0, n, 0, b""))
                continue
            took = rng.uniform(2, 20)
            amount = int(size * rng.uniform(0.3, 1.0))
            verdict = engine.charge("", "c", t, produce_bytes=amount)
            delivered.append((now + took - start, amount, n))
            heapq.heappush(events, (now + took + verdict.throttle_ms, 0, n, 0, b""))
            if member.urgent_pending:
                member.urgent_pending = False
                member.urgent_at = at = max(now, member.urgent_at + URGENT_MIN_INTERVAL_MS)
                heapq.heappush(events, (at, 1, n, -1, b""))
        elif kind == 1:  # member n reports: count >= 0 the periodic sync, -1 an urgent one
            full = count >= 0 and count % (FULL_SYNC_MS // SYNC_MS) == 0
            usage = engine.urgent_usage(t) if count < 0 else engine.local_usage(t, changed_only=not full)
            due = member.tracker.due(usage, full)
            datagrams = encode_usage(FLEET, member.sender, member.seq, EPOCH + t, full, due,
                                     engine.take_new_producer_ids(), SECRET)
            member.seq += len(datagrams)
            for other in range(3):
                if other != n:
                    for d in datagrams:
                        if rng.random() >= drop:
                            heapq.heappush(events, (now + rng.uniform(0.2, 2), 2, other, 0, d))
            member.peers.expire(t)
            if count >= 0:
                heapq.heappush(events, (now + SYNC_MS, 1, n, count + 1, b""))
            if n == 0 and die is not None:
                dead = member.peers.sender_rates(P, "", "c", t).get(die[0] + 1, 0.0)
                dead_rate.append((now - start, dead))
        else:  # a datagram arrives at member n
            try:
                member.peers.accept(decode_usage(datagram, SECRET, FLEET, EPOCH + t), t)
            except DatagramRejected as e:  # overtaken by a later one (urgent reports are close)
                assert e.reason == "replayed"
                rejected += 1
    return Run(delivered, dead_rate, rejected)


def fitted_rate(run: Run, since_ms: float, until_ms: float, members: tuple[int, ...] = (0, 1, 2)) -> float:
    """Combined rate over [since, until) in units of the quota: the slope of a line fitted to the
    cumulative bytes, the measure the integration runs use (quota_runs.slope), which does not hang
    on where Kafka's 3 s sawtooth puts the span's two ends."""
    total = 0
    points = []
    for at, size, n in sorted(run.delivered):
        if since_ms <= at < until_ms and n in members:
            total += size
            points.append((at / 1000, float(total)))
    return slope(points) / QUOTA


@pytest.mark.parametrize("drop", [0.0, 0.05])
def test_three_members_hold_three_greedy_producers_to_one_quota(drop: float) -> None:
    rates = sorted(fitted_rate(replay_fleet(seed, drop=drop), 10_000, 30_000) for seed in range(20))
    assert rates[0] >= 0.95 and rates[-1] <= 1.05, f"{rates[0]:.3f}..{rates[-1]:.3f}"


def test_without_the_fleet_three_members_give_three_times_the_quota() -> None:
    rates = sorted(fitted_rate(replay_fleet(seed, fleet=False), 10_000, 30_000) for seed in range(5))
    assert rates[0] >= 2.8 and rates[-1] <= 3.2, f"{rates[0]:.3f}..{rates[-1]:.3f}"


def test_a_dead_members_usage_ages_out_over_one_window_and_the_others_hold_the_quota() -> None:
    window_ms, die_at = 3000, 15_000
    for seed in range(10):
        run = replay_fleet(seed, die=(2, die_at), until_ms=45_000)
        # the survivors: held to the quota once the dead member's usage has aged out
        after = fitted_rate(run, die_at + DEFAULT_STALE_AFTER_MS + window_ms + 4000, 45_000, (0, 1))
        assert 0.95 <= after <= 1.05, f"seed {seed}: {after:.3f}x after the death"
        # what member 0 counts for the dead member: full for stale_after_ms after its last update
        # (at most one full sync before the death), then a straight fall to 0 over one window
        seen = [(at, rate) for at, rate in run.dead_rate if at >= die_at]
        at_death = seen[0][1]
        assert at_death > 0.1 * QUOTA
        for (at, rate), (later_at, later) in itertools.pairwise(seen):
            assert later <= rate  # never rises
            slope_bound = at_death * (later_at - at + 2) / window_ms
            assert rate - later <= slope_bound, f"seed {seed}: a step at {at}"
            if later_at < die_at + DEFAULT_STALE_AFTER_MS - FULL_SYNC_MS:
                assert later == at_death, f"seed {seed}: fell early, at {later_at}"
        assert seen[-1][1] == 0.0
        gone = next(at for at, rate in seen if rate == 0.0)
        assert gone <= die_at + DEFAULT_STALE_AFTER_MS + window_ms + 2 * SYNC_MS


def test_a_full_listing_measured_in_slices_lists_what_local_usage_lists() -> None:
    """The I/O layer measures a full report a slice at a time; the slices together are the listing."""
    from quotas.engine import QuotaEngine
    from quotas.entity import QuotaEntity
    from quotas.types import QuotaType as QT

    def engine_with_traffic() -> QuotaEngine:
        engine = QuotaEngine()
        engine.set_quotas({QuotaEntity(None, "<default>"): {QT.PRODUCE: 1000.0, QT.FETCH: 1000.0}})
        for n in range(2500):
            engine.charge("u", f"c{n}", 1_000 + n, produce_bytes=100 + n, fetch_bytes=7)
        return engine

    def order(entries: list[UsageEntry]) -> list[tuple[str, str, str, float]]:
        return sorted((e.quota.value, e.user, e.client_id, e.rate) for e in entries)

    whole = order(engine_with_traffic().local_usage(5_000))
    sliced_engine = engine_with_traffic()
    sliced = []
    for quota_type, keys in sliced_engine.full_listing():
        for start in range(0, len(keys), 333):
            sliced += sliced_engine.list_usage(quota_type, keys[start:start + 333], 5_000)
    assert len(whole) == 5000
    assert order(sliced) == whole


class _CountingBuckets(OrderedDict[str, object]):
    """The IP buckets, counting each bucket looked at: walked over or looked up by its key."""

    visited = 0

    def __iter__(self) -> Iterator[str]:
        for key in super().__iter__():
            self.visited += 1
            yield key

    def items(self) -> Iterator[tuple[str, object]]:  # type: ignore[override]
        for item in super().items():
            self.visited += 1
            yield item

    def values(self) -> Iterator[object]:  # type: ignore[override]
        for value in super().values():
            self.visited += 1
            yield value

    def get(self, key: str, default: object = None) -> object:
        self.visited += 1
        return super().get(key, default)

    def __getitem__(self, key: str) -> object:
        self.visited += 1
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.visited += 1
        return super().__contains__(key)


def test_a_slice_of_ip_buckets_is_measured_without_walking_every_bucket() -> None:
    """A full report lists the IP buckets (up to 50,000) a slice at a time: each slice looks at its
    own buckets only, so the whole listing costs the buckets listed, not buckets x slices."""
    engine = QuotaEngine()
    engine.set_quotas({QuotaEntity(None, None, DEFAULT): {QuotaType.CONNECTION_CREATION: 100.0}})
    for n in range(3000):
        engine.connections.check_ip("L", f"10.{n // 65536}.{n // 256 % 256}.{n % 256}", 1_000 + n)
    assert engine.connections.live_buckets == 3000
    counting = _CountingBuckets(engine.connections.buckets)
    engine.connections.buckets = counting  # type: ignore[assignment]
    listing = dict(engine.full_listing())[QuotaType.CONNECTION_CREATION]
    assert len(listing) == 3000
    sliced: list[UsageEntry] = []
    for start in range(0, len(listing), 100):
        keys = listing[start:start + 100]
        counting.visited = 0
        measured = engine.list_usage(QuotaType.CONNECTION_CREATION, keys, 5_000)
        assert [e.client_id for e in measured] == [key.client_id for key in keys]
        visited = counting.visited
        assert visited <= 2 * len(keys), f"{visited} buckets looked at to measure {len(keys)}"
        sliced += measured
    whole = [e for e in engine.local_usage(5_000) if e.quota is QuotaType.CONNECTION_CREATION]
    assert sliced == whole and all(e.rate > 0 for e in whole)


def test_a_senders_kept_names_give_the_same_datagrams_and_stay_bounded() -> None:
    """NameItems (kept by the tracker across reports) changes nothing on the wire, and is cleared
    when it grows past its bound instead of holding every name ever sent."""
    from quotas.fleet_datagram import NameItems

    entries = [UsageEntry(QuotaType.PRODUCE, f"user-{n}", "x" * (300 if n % 2 else 5), float(n))
               for n in range(40)]
    names = NameItems(max_items=30)
    kept = [encode_usage("f", 1, 1, 1_000, True, entries, [("user-1", 7)], b"s" * 16, names=names)
            for _ in range(2)]
    fresh = encode_usage("f", 1, 1, 1_000, True, entries, [("user-1", 7)], b"s" * 16)
    assert kept[0] == kept[1] == fresh
    assert len(names.items) == 42  # 40 users and two client ids: past the bound only by one call's
    others = [UsageEntry(QuotaType.FETCH, f"other-{n}", "c", 1.0) for n in range(5)]
    encode_usage("f", 1, 1, 1_000, True, others, [], b"s" * 16, names=names)
    assert set(names.items) == {f"other-{n}" for n in range(5)} | {"c"}  # the old ones were dropped


def test_ip_buckets_travel_in_the_fleet_reports_and_the_decision_adds_peers() -> None:
    """KIP-612 through the fleet: two members, one ip quota of 2 connections a second (3 windows of
    1 s, padded to 2 s at first: 4 connections at once); each member's IP bucket is in its usage
    (full and by slices) and the other's decision adds it, so the pair admits what one proxy would."""
    window = WindowConfig(3, 1000)
    members = []
    for sender in (1, 2):
        engine = QuotaEngine(EngineConfig(window=window))
        engine.set_quotas({QuotaEntity(None, None, "10.0.0.0/24"): {QuotaType.CONNECTION_CREATION: 2.0},
                           CLIENT: {P: QUOTA}})
        peers = PeerUsage(window.history_ms, own_sender=sender)
        engine.attach_fleet(peers)
        members.append((engine, peers))
    (a, _), (b, b_peers) = members
    assert a.table == {CLIENT: {P: QUOTA}}  # ip entities are the connection quotas'
    assert len(a.configured) == 2  # ... and the admin API still describes them
    accepted_a = [a.connections.check_ip("L", f"10.0.0.{i}", 0).accepted for i in range(3)]
    assert accepted_a == [True, True, True]
    usage = [e for e in a.local_usage(0) if e.quota is QuotaType.CONNECTION_CREATION]
    assert [(e.user, e.client_id) for e in usage] == [("", "10.0.0.0/24")] and usage[0].rate > 0
    listing = dict(a.full_listing())[QuotaType.CONNECTION_CREATION]
    assert a.list_usage(QuotaType.CONNECTION_CREATION, listing, 0) == usage
    b_peers.accept(UsageReport(FLEET, 1, 1, NOW, False, tuple(usage), ()), 0)
    accepted_b = [b.connections.check_ip("L", "10.0.0.9", 0).accepted for _ in range(4)]
    assert accepted_b == [True, False, False, False]  # 3 + 1 = the 4 one proxy admits at once
    alone = QuotaEngine(EngineConfig(window=window))
    alone.set_quotas({QuotaEntity(None, None, "10.0.0.0/24"): {QuotaType.CONNECTION_CREATION: 2.0}})
    assert [alone.connections.check_ip("L", "10.0.0.1", 0).accepted for _ in range(5)] == [True] * 4 + [False]


def test_an_ip_bucket_rising_by_two_connections_asks_once_for_an_urgent_report() -> None:
    """A storm bursts a quota window's worth at once on every member: each member's IP bucket asks
    for an urgent report once two connections were added since peers were told (5 % of a bound of
    20/s would be a dozen), so peers see the burst within milliseconds."""
    window = WindowConfig(11, 1000)
    engine = QuotaEngine(EngineConfig(window=window))
    engine.set_quotas({QuotaEntity(None, None, "10.0.0.7"): {QuotaType.CONNECTION_CREATION: 20.0},
                       QuotaEntity(None, None, "10.0.0.8"): {QuotaType.CONNECTION_CREATION: 1.0}})
    peers = PeerUsage(window.history_ms, own_sender=1)
    asked: list[int] = []
    engine.attach_fleet(peers, on_urgent=lambda: asked.append(1))
    # 20/s over a padded 10 s window: each connection adds 0.1/s; the second asks
    engine.connections.check_ip("L", "10.0.0.7", 0)
    assert asked == []
    engine.connections.check_ip("L", "10.0.0.7", 0)
    assert asked == [1]
    for _ in range(5):  # asked once until it is listed
        engine.connections.check_ip("L", "10.0.0.7", 0)
    assert asked == [1]
    urgent = engine.urgent_usage(0)
    assert [(e.quota, e.client_id, round(e.rate, 2)) for e in urgent] == [
        (QuotaType.CONNECTION_CREATION, "10.0.0.7", 0.7)]
    assert engine.urgent_usage(0) == []
    # a full window later, once listed (a full report), the second connection still asks
    engine.connections.check_ip("L", "10.0.0.7", 30_000)
    engine.connections.ip_usage(30_000)
    asked.clear()
    engine.connections.check_ip("L", "10.0.0.7", 30_001)
    assert asked == []
    engine.connections.check_ip("L", "10.0.0.7", 30_002)
    assert asked == [1]
    # a bound so low that 5 % of it is less than two connections: 5 % it is (0.05/s: the first asks)
    asked.clear()
    engine.connections.ip_usage(30_002)
    engine.connections.check_ip("L", "10.0.0.8", 30_002)
    assert asked == [1]


def test_a_delta_report_lists_only_the_ip_buckets_charged_since_the_last_one() -> None:
    """A storm from many addresses leaves many IP buckets; a delta report every 100 ms measures only
    those charged since the previous one (a full report lists them all, by slices)."""
    window = WindowConfig(11, 1000)
    engine = QuotaEngine(EngineConfig(window=window))
    engine.set_quotas({QuotaEntity(None, None, DEFAULT): {QuotaType.CONNECTION_CREATION: 20.0}})
    engine.attach_fleet(PeerUsage(window.history_ms, own_sender=1))
    for i in range(50):
        engine.connections.check_ip("L", f"10.0.1.{i}", 0)
    ips = [e for e in engine.local_usage(0, changed_only=True) if e.quota is QuotaType.CONNECTION_CREATION]
    assert len(ips) == 50
    engine.connections.check_ip("L", "10.0.1.7", 100)
    ips = [e for e in engine.local_usage(100, changed_only=True) if e.quota is QuotaType.CONNECTION_CREATION]
    assert [e.client_id for e in ips] == ["10.0.1.7"]
    assert len([e for e in engine.local_usage(100) if e.quota is QuotaType.CONNECTION_CREATION]) == 50


def test_paused_buckets_are_listed_again_in_turns_past_a_thousand() -> None:
    """A delta listing measures every paused (throttled) bucket again, so peers see its rate fall;
    past MAX_PAUSED_PER_DELTA of them it takes the longest-waiting thousand, the others next time."""
    engine = QuotaEngine(EngineConfig(window=WindowConfig(11, 1000)))
    engine.set_quotas({QuotaEntity(None, DEFAULT): {P: 1000.0}})
    engine.attach_fleet(PeerUsage(11_000, own_sender=1))
    for i in range(2500):
        assert engine.charge("u", f"c{i}", 0, produce_bytes=1_000_000).throttle_ms > 0
    assert len(engine.local_usage(1, changed_only=True)) == 2500  # charged: all of them
    # 12 s on, every sample has expired: each bucket listed again reads 0, a move peers must see
    turns = [{e.client_id for e in engine.local_usage(12_000 + n, changed_only=True)} for n in range(4)]
    assert [len(t) for t in turns] == [1000, 1000, 500, 0]
    assert set.union(*turns) == {f"c{i}" for i in range(2500)}
