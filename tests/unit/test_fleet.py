"""The fleet's pure half (issue 11): the usage datagram, peers' merged usage, what to send, and
three engines exchanging reports through the codec while greedy producers of one client id push.

Names: a *member* is one proxy (one QuotaEngine with its PeerUsage); *peers* are the others.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quotas.fleet import (
    DEFAULT_STALE_AFTER_MS,
    MAX_CLOCK_SKEW_MS,
    MAX_DATAGRAM_BYTES,
    MAX_FLEET_NAME_BYTES,
    SENDER_RETENTION_MS,
    DatagramRejected,
    PeerUsage,
    UsageEntry,
    UsageReport,
    UsageTracker,
    decode_usage,
    encode_usage,
    wire_name,
)
from quotas.types import QuotaType

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
    assert [e for r in reports for e in r.entries] == [
        UsageEntry(e.quota, wire_name(e.user), wire_name(e.client_id), f32(e.rate)) for e in entries]
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
    (b"\x01\x00\x00" + struct.pack("!QQQ", 1, 1, NOW) + b"\x01\x01u\x00\x01\x09\x00\x00" +
     struct.pack("!f", 1.0) + bytes(2), "unknown quota code 9"),
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
