"""Producer-id quotas (the KIP-936 draft): count producer ids a user shows for the first time.

"Seen before?" is answered by a time-layered Bloom filter per user, as the draft proposes: a
new filter starts every half window and takes the new ids until the next one starts; an id found
in any live filter is not new. The draft drops a filter once it is a full window old, which would
forget an id written late in a filter after only half a window; here a filter lives 1.5 windows
(so at most three exist), and every id is remembered for one to 1.5 windows.
Memory is bounded twice: each filter has a fixed size (chosen for a capacity and a target
false-positive rate), at most `MAX_LAYERS` of them per user, and only the `max_users` most
recently active users keep filters (the least recently active one is evicted first), so the
whole tracker never holds more than `max_users x MAX_LAYERS` filters: about 36 MB with the
engine's defaults (1,000 users, 10,000 ids per layer at 1 %). A user whose layers have all
expired is dropped by `expire` (a fresh filter answers exactly the same). Evicting an active user
forgets its ids: they count as new again (stricter, for that user, never looser).
A false positive means a new id is taken as already seen, i.e. not charged: the quota errs on
the lenient side, never on the punishing one.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass

#: KIP-936 draft defaults: `producer.id.quota.window.num` and `...window.size.seconds`.
DEFAULT_PID_WINDOW_SAMPLES = 11
DEFAULT_PID_WINDOW_MS = 3600 * 1000

#: Layers one user holds at most: a layer lives 1.5 windows and a new one starts every half window.
MAX_LAYERS = 3


class BloomFilter:
    """A fixed-size Bloom filter of 64-bit ids, with double hashing (Kirsch-Mitzenmacher)."""

    __slots__ = ("_bits", "count", "hashes", "size_bits")

    def __init__(self, capacity: int, false_positive_rate: float) -> None:
        if capacity < 1:
            raise ValueError(f"Bloom filter capacity must be at least 1, got {capacity}")
        if not 0 < false_positive_rate < 1:
            raise ValueError(f"false-positive rate must be in (0, 1), got {false_positive_rate}")
        bits = math.ceil(-capacity * math.log(false_positive_rate) / math.log(2) ** 2)
        self.size_bits = max(64, bits)
        self.hashes = max(1, round(self.size_bits / capacity * math.log(2)))
        self._bits = bytearray((self.size_bits + 7) // 8)
        self.count = 0

    def _positions(self, item: int) -> list[int]:
        digest = hashlib.blake2b(item.to_bytes(8, "big", signed=True), digest_size=16).digest()
        h1 = int.from_bytes(digest[:8], "big")
        h2 = int.from_bytes(digest[8:], "big") | 1
        size = self.size_bits
        return [(h1 + i * h2) % size for i in range(self.hashes)]

    def add(self, item: int) -> None:
        for pos in self._positions(item):
            self._bits[pos >> 3] |= 1 << (pos & 7)
        self.count += 1

    def __contains__(self, item: int) -> bool:
        bits = self._bits
        return all(bits[pos >> 3] & (1 << (pos & 7)) for pos in self._positions(item))

    @property
    def memory_bytes(self) -> int:
        return len(self._bits)


@dataclass(slots=True)
class _Layer:
    started_ms: int
    bloom: BloomFilter


class TimedBloomFilter:
    """Overlapping Bloom filters, one started per half window: ids are remembered 1 to 1.5 windows."""

    __slots__ = ("_capacity", "_fp_rate", "_layers", "window_ms")

    def __init__(self, window_ms: int, capacity: int, false_positive_rate: float) -> None:
        self.window_ms = window_ms
        self._capacity = capacity
        self._fp_rate = false_positive_rate
        self._layers: list[_Layer] = []

    def _rotate(self, now_ms: int) -> None:
        lifetime = self.window_ms * 3 // 2
        self._layers = [layer for layer in self._layers if now_ms - layer.started_ms < lifetime]
        if not self._layers or now_ms - self._layers[-1].started_ms >= self.window_ms // 2:
            self._layers.append(_Layer(now_ms, BloomFilter(self._capacity, self._fp_rate)))

    def expired(self, now_ms: int) -> bool:
        """Whether every layer has outlived its 1.5 windows (the filter remembers nothing)."""
        layers = self._layers
        return not layers or now_ms - layers[-1].started_ms >= self.window_ms * 3 // 2

    def add_if_new(self, pid: int, now_ms: int) -> bool:
        """True when `pid` was not seen in the last window (it is then remembered)."""
        self._rotate(now_ms)
        if any(pid in layer.bloom for layer in self._layers):
            return False
        self._layers[-1].bloom.add(pid)
        return True

    @property
    def memory_bytes(self) -> int:
        return sum(layer.bloom.memory_bytes for layer in self._layers)


class ProducerIdTracker:
    """First-seen producer ids per user, with memory bounded by `max_users` filters."""

    def __init__(self, window_ms: int = DEFAULT_PID_WINDOW_MS, capacity: int = 10_000,
                 false_positive_rate: float = 0.01, max_users: int = 1000) -> None:
        self.window_ms = window_ms
        self.capacity = capacity
        self.false_positive_rate = false_positive_rate
        self.max_users = max_users
        self._users: OrderedDict[str, TimedBloomFilter] = OrderedDict()
        self.evictions = 0

    def new_ids(self, user: str, pids: list[int], now_ms: int) -> int:
        """How many of `pids` this user shows for the first time (each counted once)."""
        bloom = self._filter(user)
        return sum(1 for pid in pids if bloom.add_if_new(pid, now_ms))

    def new_id_list(self, user: str, pids: list[int], now_ms: int) -> list[int]:
        """Which of `pids` this user shows for the first time (a fleet tells its peers about them)."""
        bloom = self._filter(user)
        return [pid for pid in pids if bloom.add_if_new(pid, now_ms)]

    def _filter(self, user: str) -> TimedBloomFilter:
        """The user's filter, made if needed (evicting the least recently active user past the cap)."""
        bloom = self._users.get(user)
        if bloom is None:
            bloom = TimedBloomFilter(self.window_ms, self.capacity, self.false_positive_rate)
            self._users[user] = bloom
            if len(self._users) > self.max_users:
                self._users.popitem(last=False)
                self.evictions += 1
        else:
            self._users.move_to_end(user)
        return bloom

    def expire(self, now_ms: int, budget: int) -> tuple[int, int]:
        """Drop users whose filters remember nothing, least recently active first.

        Stops at the first user that still remembers an id (or after `budget` users); returns
        (users dropped, users examined). A dropped user starts over with an empty filter, which
        answers exactly as its expired layers would have.
        """
        users = self._users
        dropped = examined = 0
        while users and examined < budget:
            user, bloom = next(iter(users.items()))
            examined += 1
            if not bloom.expired(now_ms):
                break
            del users[user]
            dropped += 1
        return dropped, examined

    @property
    def memory_bytes(self) -> int:
        return sum(bloom.memory_bytes for bloom in self._users.values())

    @property
    def users(self) -> int:
        return len(self._users)
