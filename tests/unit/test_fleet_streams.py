"""Each stream of the fleet exchange has one declared kind, read by the sender and the receiver
alike (quotas/fleet_streams.py): a RATE fades, a TOTAL is debited by its growth, a LEVEL counts as
it is while fresh."""

from __future__ import annotations

import pytest

from quotas.fleet import PeerUsage, UsageEntry, UsageReport, UsageTracker, decode_usage, encode_usage
from quotas.fleet_streams import STREAMS, StreamKind
from quotas.types import CapacityStream, QuotaType

WINDOW_MS = 11_000
STALE_MS = 3000
SECRET = b"s" * 32


def _report(seq: int, *entries: UsageEntry, sender: int = 7) -> UsageReport:
    return UsageReport("f", sender, seq, 0, False, entries, ())


def test_every_stream_declares_a_kind_and_a_unique_wire_code() -> None:
    codes = [declared.code for declared in STREAMS.values()]
    assert len(set(codes)) == len(codes)
    assert STREAMS[QuotaType.PRODUCE].kind is StreamKind.RATE
    assert STREAMS[QuotaType.CONTROLLER_MUTATION].kind is StreamKind.TOTAL
    assert STREAMS[CapacityStream.CAPACITY_FACTOR].kind is StreamKind.LEVEL
    assert STREAMS[CapacityStream.CAPACITY_PRODUCE].kind is StreamKind.RATE


def test_the_wire_codes_are_those_of_version_1() -> None:
    """Members of different versions of this code still understand each other."""
    expected = {QuotaType.PRODUCE: 0, QuotaType.FETCH: 1, QuotaType.REQUEST: 2,
                QuotaType.CONTROLLER_MUTATION: 3, QuotaType.PRODUCER_IDS: 4, QuotaType.CONNECTION_CREATION: 5,
                CapacityStream.CAPACITY_PRODUCE: 6, CapacityStream.CAPACITY_FETCH: 7,
                CapacityStream.CAPACITY_REQUEST: 8, CapacityStream.CAPACITY_FACTOR: 9}
    assert {stream: STREAMS[stream].code for stream in expected} == expected
    for stream, code in expected.items():
        datagram = encode_usage("f", 1, 1, 1000, False, [UsageEntry(stream, "u", "c", 2.0)], (), SECRET)[0]
        # entry: code u8 | user index u8 | client index u8 | rate f32, just before the two counts and MAC
        assert datagram[-32 - 2 - 7] == code
        assert decode_usage(datagram, SECRET, "f", 1000).entries[0].quota is stream


def test_a_rate_fades_over_one_quota_window_once_stale() -> None:
    peers = PeerUsage(WINDOW_MS, STALE_MS)
    peers.accept(_report(1, UsageEntry(QuotaType.PRODUCE, "u", "c", 100.0)), 0)
    view = peers.view(QuotaType.PRODUCE)
    assert view.rate(("u", "c"), STALE_MS) == 100.0
    assert view.rate(("u", "c"), STALE_MS + WINDOW_MS // 2) == pytest.approx(50.0, rel=0.01)
    assert view.rate(("u", "c"), STALE_MS + WINDOW_MS) == 0.0


def test_a_level_counts_as_it_is_while_fresh_then_not_at_all() -> None:
    peers = PeerUsage(WINDOW_MS, STALE_MS)
    factor = CapacityStream.CAPACITY_FACTOR
    peers.accept(_report(1, UsageEntry(factor, "", "", 0.6)), 0)
    peers.accept(_report(1, UsageEntry(factor, "", "", 0.8), sender=8), 1000)
    view = peers.view(factor)
    assert view.kind is StreamKind.LEVEL
    assert sorted(view.levels(("", ""), STALE_MS)) == [0.6, 0.8]  # unweighted, never summed
    assert view.levels(("", ""), STALE_MS + 1) == [0.8]  # stale: gone, not faded
    assert view.levels(("", ""), STALE_MS + 1001) == []


def test_a_total_is_debited_by_what_it_grew_and_has_no_view() -> None:
    peers = PeerUsage(WINDOW_MS, STALE_MS)
    debits: list[tuple[tuple[str, str], float, bool]] = []
    peers.ledger(QuotaType.CONTROLLER_MUTATION).on_debit = lambda key, debit, whole, now: debits.append(
        (key, debit, whole))
    mutations = QuotaType.CONTROLLER_MUTATION
    peers.accept(_report(1, UsageEntry(mutations, "", "admin", 5.0)), 0)
    peers.accept(_report(2, UsageEntry(mutations, "", "admin", 8.0)), 10)
    peers.accept(_report(3, UsageEntry(mutations, "", "admin", 8.0)), 20)  # no growth: nothing
    assert debits == [(("", "admin"), 5.0, True), (("", "admin"), 3.0, False)]
    assert len(peers) == 0, "a total holds no rate slot"
    with pytest.raises(KeyError):
        peers.view(mutations)
    assert peers.expire(STALE_MS + WINDOW_MS + 20) == 1  # aged as a total: forgotten after a window


def test_the_sender_resends_a_total_on_any_change_and_a_rate_or_level_past_the_ratio() -> None:
    tracker = UsageTracker(change_ratio=0.01)
    kinds = {QuotaType.CONTROLLER_MUTATION: True, QuotaType.PRODUCE: False,
             CapacityStream.CAPACITY_FACTOR: False}
    for stream, any_change in kinds.items():
        first = [UsageEntry(stream, "u", "c", 1000.0)]
        assert tracker.due(first, False) == first
        nudged = [UsageEntry(stream, "u", "c", 1001.0)]  # 0.1 %
        assert (tracker.due(nudged, False) == nudged) is any_change, stream
        moved = [UsageEntry(stream, "u", "c", 1100.0)]
        assert tracker.due(moved, False) == moved
