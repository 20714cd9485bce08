"""The controller mutation quota over a fleet: running totals, debited from every member's copy."""

from __future__ import annotations

import random

from quotas.engine import QuotaEngine
from quotas.entity import QuotaEntity
from quotas.fleet import CountLedger, PeerUsage, UsageEntry, UsageReport, UsageTracker
from quotas.types import QuotaType

M = QuotaType.CONTROLLER_MUTATION
RATE = 2.0
BURST = 11 * RATE  # Kafka's controller.quota.window.num x size x rate


class Member:
    def __init__(self, sender: int) -> None:
        self.sender = sender
        self.engine = QuotaEngine()
        self.engine.set_quotas({QuotaEntity(None, "admin"): {M: RATE}})
        self.peers = PeerUsage(self.engine.config.window.history_ms, own_sender=sender)
        self.engine.attach_fleet(self.peers)
        self.seq = 0

    def report(self, now_ms: int, full: bool = False) -> UsageReport:
        self.seq += 1
        entries = self.engine.local_usage(now_ms, changed_only=not full)
        return UsageReport("f", self.sender, self.seq, 0, full, tuple(e for e in entries if e.quota is M), ())

    def create(self, now_ms: int) -> bool:
        """One strict CreateTopics of one 1-partition topic: accepted?"""
        return self.engine.charge_mutations("", "admin", [1], True, now_ms).accepted[0]

    def tokens(self, now_ms: int) -> float:
        manager = self.engine.controller_mutation
        return manager.tokens(next(iter(manager.buckets.values())), now_ms)


def run(members: list[Member], seconds: int, loss: float = 0.0, seed: int = 1) -> int:
    """A client creating topics as fast as it may, each request on the next member; every member
    reports after each request (the urgent report a charge asks for), `loss` of them lost."""
    rng = random.Random(seed)
    accepted = 0
    for step in range(seconds * 100):
        now = step * 10
        member = members[step % len(members)]
        accepted += member.create(now)
        report = member.report(now)
        for other in members:
            if other is not member and rng.random() >= loss:
                other.peers.accept(report, now)
    return accepted


def test_three_members_allow_the_quota_once() -> None:
    # a strict bucket accepts while not in debt: burst + rate x time, give or take a topic
    fleet = run([Member(1), Member(2), Member(3)], 30)
    assert BURST + RATE * 30 - 1 <= fleet <= BURST + RATE * 30 + 3, fleet
    alone = run([Member(1)], 30)
    assert BURST + RATE * 30 - 1 <= alone <= BURST + RATE * 30 + 1, alone
    # without the exchange, each member's bucket is its own
    apart = [Member(1), Member(2), Member(3)]
    for member in apart:
        member.peers.ledger(M).on_debit = None
    assert run(apart, 30) >= 2.5 * (BURST + RATE * 30)


def test_lost_reports_cost_nothing_the_next_total_carries_them() -> None:
    fleet = run([Member(1), Member(2), Member(3)], 30, loss=0.3, seed=7)
    assert BURST + RATE * 30 - 1 <= fleet <= BURST + RATE * 30 + 6, fleet


def test_a_total_heard_first_is_debited_whole_up_to_one_burst() -> None:
    a = Member(1)
    for second in range(40):  # 100 partitions over 40 s: a's copy is near full again
        a.engine.charge_mutations("", "admin", [2, 1] if second % 2 else [2], False, second * 1000)
    late = Member(2)  # starts now: a's total (100) may be old, so at most a burst is debited
    late.peers.accept(a.report(40_000, full=True), 40_000)
    assert late.tokens(40_000) == 0.0
    # a new bucket on a known member is debited whole: 5 partitions
    b = Member(3)
    b.peers.accept(UsageReport("f", 1, 1, 0, False, (UsageEntry(M, "", "admin", 5.0),), ()), 0)
    assert b.tokens(0) == BURST - 5
    b.peers.accept(UsageReport("f", 1, 2, 0, False, (UsageEntry(M, "", "admin", 8.0),), ()), 0)
    assert b.tokens(0) == BURST - 8
    # the member made the bucket again (its total fell): the new total counts whole
    b.peers.accept(UsageReport("f", 1, 3, 0, False, (UsageEntry(M, "", "admin", 2.0),), ()), 0)
    assert b.tokens(0) == BURST - 10
    # a key no quota here leads to is left alone
    b.peers.accept(UsageReport("f", 1, 4, 0, False, (UsageEntry(M, "", "other", 9.0),), ()), 0)
    assert len(b.engine.controller_mutation.buckets) == 1


def test_totals_are_sent_on_every_change_and_a_dropped_bucket_once_as_0() -> None:
    tracker = UsageTracker()
    first = [UsageEntry(M, "", "admin", 1000.0)]
    assert tracker.due(first, True) == first
    one_more = [UsageEntry(M, "", "admin", 1001.0)]  # 0.1 %: a rate this close would wait
    assert tracker.due(one_more, False) == one_more
    assert tracker.due([], True) == [UsageEntry(M, "", "admin", 0.0)]
    ledger = CountLedger(max_entries=2)
    assert ledger.heard(1, "", "a", 4.0, 0) == (4.0, True)
    assert ledger.heard(1, "", "a", 6.0, 0) == (2.0, False)
    assert ledger.heard(1, "", "a", 0.0, 0) == (0.0, False)  # forgotten: the next is whole
    assert ledger.heard(1, "", "a", 3.0, 0) == (3.0, True)
    ledger.heard(2, "", "a", 1.0, 0)
    ledger.heard(3, "", "a", 1.0, 5)  # bounded: the least recently heard goes
    assert len(ledger) == 2
    assert ledger.expire(20_000, older_than_ms=14_000) == 2
    assert len(ledger) == 0


def test_a_member_lists_its_totals_in_full_and_delta_reports() -> None:
    a = Member(1)
    asked: list[int] = []
    a.engine.attach_fleet(a.peers, on_urgent=lambda: asked.append(1))
    a.create(0)
    assert asked == [1]
    assert a.engine.urgent_usage(0) == [UsageEntry(M, "", "admin", 1.0)]
    assert a.engine.local_usage(0, changed_only=True) == []
    a.create(10)
    listing = dict(a.engine.full_listing())
    assert [k.client_id for k in listing[M]] == ["admin"]
    assert a.engine.list_usage(M, listing[M], 10) == [UsageEntry(M, "", "admin", 2.0)]
