"""The pure half of the fleet: one quota over several proxies (issue 11).

Every member decides locally; beside that, members tell each other their *absolute* windowed
rate per bucket (never deltas, so a lost datagram only delays convergence) and each adds the
peers' latest rates to its own before applying Kafka's throttle formula. This module holds
everything about that exchange that needs no socket and no clock of its own:

- the usage datagram: `encode_usage` / `decode_usage`, HMAC-SHA256 signed with the fleet secret,
  at most `MAX_DATAGRAM_BYTES` each, with a per-datagram string table so that one entry costs
  7 bytes plus its share of the names;
- `PeerUsage`: what peers reported, with replay protection per sender, read per stream as the
  stream's declared kind says (fleet_streams.py): a rate's ageing rule (full weight while fresh,
  then linearly to 0 over one quota window: never a step, which would give a dead member's clients
  a fresh burst), a level's (as it is while fresh, then nothing), a total's growth (`CountLedger`);
  each `ClientQuotaManager` reads its `PeerView` per charge (one dict lookup, and one comparison
  while the peers' reports are fresh);
- `UsageTracker`: what this member must send next (changed entries every sync, all every full sync;
  a total on every change, as its kind says).

Freshness decides the accuracy. When headroom opens, every member's clients rush into it at once,
and a member sees the others' rush only when they report; so besides the periodic syncs, a bucket
whose rate rose by URGENT_CHANGE_RATIO of its bound asks for an urgent delta report (the engine's
`on_urgent`), and a throttled bucket is listed in every delta while its client is paused (its rate
falls, and peers that kept its old rate would under-admit). With both, three greedy producers on
three members hold one quota as closely as one proxy holds three connections (test_fleet.py).

The datagram itself (its wire format, signing and parsing) is fleet_datagram.py.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

from .fleet_datagram import (
    MAX_CLOCK_SKEW_MS,
    MAX_DATAGRAM_BYTES,
    MAX_FLEET_NAME_BYTES,
    MAX_LITERAL_NAME_BYTES,
    MIN_SECRET_BYTES,
    REJECT_REASONS,
    DatagramRejected,
    NameItems,
    UsageEntry,
    UsageReport,
    decode_usage,
    encode_usage,
    wire_name,
)
from .fleet_streams import SENT_ON_ANY_CHANGE, STREAMS, STREAMS_BY_NAME, StreamKind
from .types import UsageKind

#: A peer's entry counts at full weight for this long after its last update: three full syncs
#: (`full_sync_interval_ms` 1000), so two lost full syncs in a row change nothing.
DEFAULT_STALE_AFTER_MS = 3000

#: Peer entries kept at most (all peers and quota types together); past it the least recently
#: updated is evicted. Kafka has no such bound; ~300 bytes each, so 200,000 is about 60 MB.
DEFAULT_MAX_PEER_ENTRIES = 200_000

#: A sender is remembered (its highest sequence number, for replay protection) this long after its
#: last datagram: a captured datagram passes the skew check for at most 2 x MAX_CLOCK_SKEW_MS
#: after it was first received (sender clock ahead by the skew, receiver accepting it the skew late).
SENDER_RETENTION_MS = 2 * MAX_CLOCK_SKEW_MS

#: A report's rate changes by more than this ratio before it is sent again between full syncs
#: (Pulsar's PIP-82 resource groups suppress below 5 %; the fleet aims at 5 % accuracy, so 1 %).
DEFAULT_CHANGE_RATIO = 0.01

#: A bucket whose local rate has risen by more than this share of its bound since it was last
#: reported asks for an urgent report (`QuotaEngine.attach_fleet(on_urgent=...)`): when headroom
#: opens, every member's clients rush into it at once, and each member sees the others' rush only
#: when they report. With reports every 100 ms only, three greedy producers overshoot and then pay
#: it back in long throttles (tests/unit/test_fleet.py, last 20 s of 30 s, fitted: 0.99-1.10x the
#: quota, 0.98-1.16x with 5 % loss); with urgent reports 0.98-1.03x, as one proxy alone.
URGENT_CHANGE_RATIO = 0.05

#: Urgent reports a member sends at most one per this interval (bounds their traffic to 100
#: delta syncs a second, each only of the entries that changed).
URGENT_MIN_INTERVAL_MS = 10

#: Between full syncs, a charged bucket is listed for a delta sync only when its rate moved by more
#: than this share of its bound since it was last listed: what a peer's decision can be off by
#: (1 % of the bound per member), without resending every small wobble of a bucket far below it.
DELTA_CHANGE_OF_BOUND = 0.01

#: New producer ids a member keeps for its next report at most; past it they are not announced
#: (a peer that sees one of them later counts it again: stricter, never looser). KIP-936 expects
#: new ids to be rare; 10,000 between two syncs is a flood.
MAX_PENDING_PRODUCER_IDS = 10_000

#: Work `PeerUsage.expire` does per call by default (entries examined).
EXPIRY_BUDGET = 4096

# -- what peers reported ------------------------------------------------------------------------


class _Slot:
    """One peer's latest rate for one bucket."""

    __slots__ = ("key", "rate", "sender", "updated_ms", "view")

    def __init__(self, view: PeerView, key: tuple[str, str], sender: _Sender, rate: float,
                 updated_ms: int) -> None:
        self.view = view
        self.key = key
        self.sender = sender
        self.rate = rate
        self.updated_ms = updated_ms


class PeerReports:
    """Every peer's slot for one bucket, with what the hot path needs precomputed: while no slot
    has aged past `stale_after_ms` (the usual case: peers refresh every full sync), the peers'
    rate is `total`, one comparison away (`ClientQuotaManager.record` reads it inline)."""

    __slots__ = ("fresh_until_ms", "slots", "total")

    def __init__(self, slot: _Slot, stale_after_ms: int) -> None:
        self.slots = [slot]
        self.total = slot.rate
        self.fresh_until_ms = slot.updated_ms + stale_after_ms

    def refresh(self, stale_after_ms: int) -> None:
        slots = self.slots
        self.total = sum(slot.rate for slot in slots)
        self.fresh_until_ms = min(slot.updated_ms for slot in slots) + stale_after_ms


class _Sender:
    """A member incarnation: replay protection and liveness."""

    __slots__ = ("entries", "highest_seq", "id", "last_ms")

    def __init__(self, sender_id: int, seq: int, now_ms: int) -> None:
        self.id = sender_id
        self.highest_seq = seq
        self.last_ms = now_ms
        self.entries = 0


class PeerView:
    """Peers' values for one RATE or LEVEL stream: a rate is what a `ClientQuotaManager` asks on
    every recording (`rate`), a level what the capacity factor reads (`levels`).

    The manager holds its view, so the hot path costs one dict lookup by its bucket key (no
    enum hashing) and, for a key peers reported, one comparison while every report is fresh,
    else a loop over the peers that reported it.
    """

    __slots__ = ("_peers", "has_digests", "kind", "quota", "reports")

    def __init__(self, peers: PeerUsage, quota: UsageKind, kind: StreamKind) -> None:
        self._peers = peers
        self.quota = quota
        #: how its values are read: RATE (`rate`, fading) or LEVEL (`levels`, fresh only)
        self.kind = kind
        #: (user, client-id) in wire form -> the slots of the peers reporting it
        self.reports: dict[tuple[str, str], PeerReports] = {}
        #: whether any key in digest form was ever reported (lookups then map long names)
        self.has_digests = False

    def rate(self, key: tuple[str, str], now_ms: int) -> float:
        """Sum of peers' weighted rates for bucket `key` (user, client-id)."""
        reports = self.reports.get(key)
        if reports is None:
            if not self.has_digests:
                return 0.0
            wire = (wire_name(key[0]), wire_name(key[1]))
            if wire == key:
                return 0.0
            reports = self.reports.get(wire)
            if reports is None:
                return 0.0
        if now_ms <= reports.fresh_until_ms:
            return reports.total
        peers = self._peers
        stale = peers.stale_after_ms
        total = 0.0
        for slot in reports.slots:
            age = now_ms - slot.updated_ms
            if age <= stale:
                total += slot.rate
            else:
                weight = 1.0 - (age - stale) / peers.quota_window_ms
                if weight > 0.0:
                    total += slot.rate * weight
        return total

    def weighted(self, slot: _Slot, now_ms: int) -> float:
        """One slot's rate times its weight (the rule `rate` applies inline)."""
        age = now_ms - slot.updated_ms - self._peers.stale_after_ms
        return slot.rate if age <= 0 else slot.rate * max(0.0, 1.0 - age / self._peers.quota_window_ms)

    def levels(self, key: tuple[str, str], now_ms: int) -> list[float]:
        """A LEVEL stream's read: each peer's value for `key` reported within `stale_after_ms`, as
        it is (a level must not fade towards 0, nor count once stale)."""
        reports = self.reports.get(key)
        if reports is None:
            return []
        stale = self._peers.stale_after_ms
        return [slot.rate for slot in reports.slots if now_ms - slot.updated_ms <= stale]

    def rates(self, now_ms: int) -> dict[tuple[str, str], float]:
        """Every reported bucket with its peers' weighted rate (for metrics; not for the hot path)."""
        return {key: self.rate(key, now_ms) for key in self.reports}

    def __len__(self) -> int:
        return len(self.reports)


class CountLedger:
    """Peers' running totals of one TOTAL stream (controller mutations): what each report adds.

    A rate is state, so a peer's latest replaces its previous one; a token bucket is debited by
    events, so the fleet exchanges, per bucket, the partitions each member charged since it created
    the bucket, and a receiver debits what a total grew by since it last heard it. A lost datagram
    costs nothing: the next total carries what it held. A total heard for the first time (a bucket
    new on its member, or a receiver that just started) or one that fell (its member dropped the
    bucket and made it again) is debited whole, and the receiver caps that debit at one burst: a
    restarted receiver is then stricter for at most one refill, never looser.
    """

    __slots__ = ("_totals", "max_entries", "on_debit")

    def __init__(self, max_entries: int = DEFAULT_MAX_PEER_ENTRIES) -> None:
        self.max_entries = max_entries
        #: where what a peer's total grew by goes ((user, client-id) in wire form, what to debit,
        #: debited whole, now); None: heard and dropped. `QuotaEngine.attach_fleet` sets it.
        self.on_debit: Callable[[tuple[str, str], float, bool, int], None] | None = None
        #: (sender, user, client-id) -> (the last total heard, when), least recently heard first
        self._totals: OrderedDict[tuple[int, str, str], tuple[float, int]] = OrderedDict()

    def heard(self, sender: int, user: str, client_id: str, total: float, now_ms: int) -> tuple[float, bool]:
        """A peer's total for one bucket: (what to debit, whether it is debited whole)."""
        key = (sender, user, client_id)
        totals = self._totals
        last = totals.pop(key, None)
        if total <= 0.0:  # the member dropped the bucket
            return 0.0, False
        if len(totals) >= self.max_entries:
            totals.popitem(last=False)
        totals[key] = (total, now_ms)
        if last is None or total < last[0]:
            return total, True
        return total - last[0], False

    def expire(self, now_ms: int, older_than_ms: int, budget: int = EXPIRY_BUDGET) -> int:
        """Forget totals not heard for `older_than_ms` (a member lists its buckets every full sync)."""
        totals = self._totals
        dropped = 0
        while totals and dropped < budget:
            key, (_, heard_ms) = next(iter(totals.items()))
            if now_ms - heard_ms < older_than_ms:
                break
            del totals[key]
            dropped += 1
        return dropped

    def __len__(self) -> int:
        return len(self._totals)


class PeerUsage:
    """What peers reported, merged; the engine asks it for the peers' rate of a bucket.

    A report's entry replaces the sender's previous rate for that bucket (absolute state). An
    entry counts at full weight while it is at most `stale_after_ms` old (since its last update,
    on this member's clock), then with weight max(0, 1 - (age - stale_after_ms) / quota_window_ms):
    a dead member, and a bucket a peer stopped reporting, fade out over one quota window rather
    than vanishing. A rate of 0 is removed at once (it weighs nothing either way).
    """

    def __init__(self, quota_window_ms: int, stale_after_ms: int = DEFAULT_STALE_AFTER_MS,
                 max_entries: int = DEFAULT_MAX_PEER_ENTRIES, *, own_sender: int | None = None) -> None:
        if quota_window_ms < 1:
            raise ValueError(f"quota_window_ms must be at least 1, got {quota_window_ms}")
        if stale_after_ms < 0:
            raise ValueError(f"stale_after_ms must not be negative, got {stale_after_ms}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}")
        self.quota_window_ms = quota_window_ms
        self.stale_after_ms = stale_after_ms
        self.max_entries = max_entries
        #: this member's own incarnation id: its own datagrams (a peer list naming every member,
        #: this one included) are ignored rather than counted twice
        self.own_sender = own_sender
        # each stream's store, as its declared kind says: a view of slots (RATE, LEVEL) or a ledger
        self._views = {stream: PeerView(self, stream, declared.kind) for stream, declared in STREAMS.items()
                       if declared.kind is not StreamKind.TOTAL}
        self._views_by_name = {stream._name_: view for stream, view in self._views.items()}
        self._ledgers = {stream: CountLedger(max_entries) for stream, declared in STREAMS.items()
                         if declared.kind is StreamKind.TOTAL}
        self._ledgers_by_name = {stream._name_: ledger for stream, ledger in self._ledgers.items()}
        #: every slot, least recently updated first (expiry and eviction take from the front)
        self._order: OrderedDict[_Slot, None] = OrderedDict()
        self._senders: dict[int, _Sender] = {}
        #: entries evicted because `max_entries` was reached (their usage dropped early)
        self.evicted = 0

    def view(self, quota: UsageKind) -> PeerView:
        """The view of a RATE or LEVEL stream (see `PeerView.rate`, `PeerView.levels`)."""
        return self._views[quota]

    def ledger(self, stream: UsageKind) -> CountLedger:
        """The ledger of a TOTAL stream (see `CountLedger`; its `on_debit` takes what peers add)."""
        return self._ledgers[stream]

    def accept(self, report: UsageReport, now_ms: int) -> None:
        """Apply a verified report (raises DatagramRejected("replayed") if seq <= the sender's highest)."""
        if report.sender == self.own_sender:
            return
        sender = self._senders.get(report.sender)
        if sender is None:
            sender = self._senders[report.sender] = _Sender(report.sender, report.seq, now_ms)
        elif report.seq <= sender.highest_seq:
            raise DatagramRejected("replayed", f"seq {report.seq} from {report.sender:#x}, "
                                               f"already at {sender.highest_seq}")
        sender.highest_seq = report.seq
        sender.last_ms = now_ms
        order = self._order
        stale_after = self.stale_after_ms
        views = self._views_by_name
        for entry in report.entries:
            quota, user, client_id, rate = entry
            view = views.get(quota._name_)  # an enum's own hash is a Python call
            if view is None:  # a TOTAL stream: what its total grew by is debited
                ledger = self._ledgers_by_name[quota._name_]
                debit, whole = ledger.heard(sender.id, user, client_id, rate, now_ms)
                if debit > 0.0 and ledger.on_debit is not None:
                    ledger.on_debit((user, client_id), debit, whole, now_ms)
                continue
            key = (user, client_id)
            reports = view.reports.get(key)
            slot = None
            if reports is not None:
                slots = reports.slots
                if len(slots) == 1:
                    # The usual case (the bucket's connections are on one peer): refresh inline,
                    # a full sync passes here once per bucket per second.
                    only = slots[0]
                    if only.sender is sender:
                        if rate > 0.0:
                            only.rate = reports.total = rate
                            only.updated_ms = now_ms
                            reports.fresh_until_ms = now_ms + stale_after
                            order.move_to_end(only)
                        else:
                            self._remove(only)
                        continue
                else:
                    for candidate in slots:
                        if candidate.sender is sender:
                            slot = candidate
                            break
            if slot is not None and reports is not None:
                if rate > 0.0:
                    slot.rate = rate
                    slot.updated_ms = now_ms
                    order.move_to_end(slot)
                    reports.refresh(stale_after)
                else:
                    self._remove(slot)
            elif rate > 0.0:
                if len(order) >= self.max_entries and not self.expire(now_ms, budget=16):
                    self._remove(next(iter(order)))
                    self.evicted += 1
                slot = _Slot(view, key, sender, rate, now_ms)
                reports = view.reports.get(key)  # eviction may have removed it
                if reports is None:
                    view.reports[key] = PeerReports(slot, stale_after)
                else:
                    reports.slots.append(slot)
                    reports.refresh(stale_after)
                order[slot] = None
                sender.entries += 1
                if len(user) > MAX_LITERAL_NAME_BYTES or len(client_id) > MAX_LITERAL_NAME_BYTES:
                    view.has_digests = True

    def _remove(self, slot: _Slot) -> None:
        del self._order[slot]
        by_key = slot.view.reports
        reports = by_key[slot.key]
        reports.slots.remove(slot)
        if reports.slots:
            reports.refresh(self.stale_after_ms)
        else:
            del by_key[slot.key]
        slot.sender.entries -= 1

    def peer_rate(self, quota: UsageKind, user: str, client_id: str, now_ms: int) -> float:
        """Sum over peers of their weighted rates for this bucket key (see `PeerView.rate`)."""
        return self._views[quota].rate((user, client_id), now_ms)

    def sender_rates(self, quota: UsageKind, user: str, client_id: str, now_ms: int) -> dict[int, float]:
        """Each peer's weighted rate for one bucket (introspection: which member brings what)."""
        view = self._views[quota]
        reports = view.reports.get((wire_name(user), wire_name(client_id)))
        slots = reports.slots if reports is not None else []
        return {slot.sender.id: view.weighted(slot, now_ms) for slot in slots}

    def members(self, now_ms: int) -> dict[int, int]:
        """Every sender heard from within SENDER_RETENTION_MS -> ms since its last datagram."""
        return {sender.id: now_ms - sender.last_ms for sender in self._senders.values()
                if now_ms - sender.last_ms < SENDER_RETENTION_MS}

    def expire(self, now_ms: int, budget: int = EXPIRY_BUDGET) -> int:
        """Drop entries whose weight reached 0 (at most `budget` examined); returns how many went.

        Also forgets senders with no entries left once SENDER_RETENTION_MS has passed since their
        last datagram (so a restarted member's old incarnation does not linger).
        """
        limit = self.stale_after_ms + self.quota_window_ms
        order = self._order
        dropped = 0
        while order and dropped < budget:
            slot = next(iter(order))
            if now_ms - slot.updated_ms < limit:
                break
            self._remove(slot)
            dropped += 1
        for ledger in self._ledgers.values():
            dropped += ledger.expire(now_ms, limit, budget)
        gone = [sender_id for sender_id, sender in self._senders.items()
                if not sender.entries and now_ms - sender.last_ms >= SENDER_RETENTION_MS]
        for sender_id in gone:
            del self._senders[sender_id]
        return dropped

    def __len__(self) -> int:
        """Peer entries held (all peers and quota types)."""
        return len(self._order)


# -- what to send ---------------------------------------------------------------------------------


class UsageTracker:
    """What this member must send next: changed entries every sync, everything every full sync.

    Compares with what was last *sent*, so slow drift accumulates until it crosses the ratio (a
    stream whose kind is resent on any change, a TOTAL, at every change). A value that went to 0
    is sent once; a bucket that disappeared from a full listing (it expired
    locally) is sent once as 0 and forgotten, so peers drop it without waiting for it to age out.
    """

    def __init__(self, change_ratio: float = DEFAULT_CHANGE_RATIO) -> None:
        if not 0.0 <= change_ratio < 1.0:
            raise ValueError(f"change_ratio must be in [0, 1), got {change_ratio}")
        self.change_ratio = change_ratio
        #: the names' string-table items, kept across this member's reports (`encode_usage`)
        self.names = NameItems()
        #: (quota name, user, client-id) -> the rate last sent
        self._sent: dict[tuple[str, str, str], float] = {}

    def due(self, current: Iterable[UsageEntry], full: bool) -> list[UsageEntry]:
        """The entries to send now. With `full`, `current` must list every live bucket; without,
        it may list only some (`QuotaEngine.local_usage(now_ms, changed_only=True)`)."""
        ratio = self.change_ratio
        any_change = SENT_ON_ANY_CHANGE
        out: list[UsageEntry] = []
        sent = self._sent
        if not full:
            for entry in current:
                quota, user, client_id, rate = entry
                key = (quota._name_, user, client_id)  # an enum's own hash is a Python call
                last = sent.get(key)
                if rate == 0.0:
                    if last:  # went to 0: once
                        out.append(entry)
                        sent[key] = 0.0
                elif last is None or abs(rate - last) > ratio * last or (
                        rate != last and key[0] in any_change):
                    out.append(entry)
                    sent[key] = rate
            return out
        # A full sync: everything with a rate, 0 once for what stopped, and what is no longer
        # listed (its bucket expired) sent as 0 if peers still hold a rate for it, then forgotten.
        listed: dict[tuple[str, str, str], float] = {}
        for entry in current:
            quota, user, client_id, rate = entry
            key = (quota._name_, user, client_id)
            last = sent.pop(key, None)
            if rate != 0.0 or last:
                out.append(entry)
            listed[key] = rate
        for (name, user, client_id), last in sent.items():
            if last:
                out.append(UsageEntry(STREAMS_BY_NAME[name], user, client_id, 0.0))
        self._sent = listed
        return out

    def __len__(self) -> int:
        return len(self._sent)


#: The datagram's names are re-exported: the engine, the exchange and the config read them here.
__all__ = [
    "DEFAULT_CHANGE_RATIO", "DEFAULT_MAX_PEER_ENTRIES", "DEFAULT_STALE_AFTER_MS", "DELTA_CHANGE_OF_BOUND",
    "EXPIRY_BUDGET", "MAX_CLOCK_SKEW_MS", "MAX_DATAGRAM_BYTES", "MAX_FLEET_NAME_BYTES",
    "MAX_PENDING_PRODUCER_IDS", "MIN_SECRET_BYTES", "REJECT_REASONS", "SENDER_RETENTION_MS",
    "URGENT_CHANGE_RATIO", "URGENT_MIN_INTERVAL_MS", "CountLedger", "DatagramRejected", "NameItems",
    "PeerReports", "PeerUsage", "PeerView", "StreamKind", "UsageEntry", "UsageReport", "UsageTracker",
    "decode_usage", "encode_usage", "wire_name",
]
