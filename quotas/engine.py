"""All of a client's quotas together: what one request costs and how long to throttle it.

The proxy calls `charge` once per request, when the response is ready (for Produce with acks=0,
when the request arrives), with everything the request used. Like a broker, the throttle is the
largest of the violated quotas, and only that quota's throttle-time sensor records it (a tie goes
to the request quota). A throttled Fetch is not counted against the byte rate, since its records
are not delivered (Kafka un-records it and answers empty).

In a fleet (several proxies, one quota: see fleet.py), `attach_fleet` makes every decision use the
bucket's own rate plus its peers' latest ones; the proxy's exchange reads `local_usage` and
`take_new_producer_ids` for its reports and feeds what peers report into the PeerUsage and
`learn_producer_ids`. Without a fleet none of that costs anything.

KIP-612's connection quotas (`connections`: connection_quotas.py) live beside the client quotas:
`set_quotas` hands them the `ip` entities, and their IP buckets travel in the same fleet reports
(quota type CONNECTION_CREATION, keyed ("", bucket)), so N proxies hold one IP quota.

A cluster capacity (`capacity`: capacity.py), when configured, is charged beside the quotas:
each charge also counts to its tenant's demand, and past its fair share the tenant is throttled
by the capacity. The larger of the quotas' and the capacity's throttle wins, and the Verdict says
which (`capacity`), so the metrics and usage events count them apart. Without a `[capacity]`
table that costs one attribute test per charge.

With usage events on (`usage`: quotas/usage.py), every charge is also counted per (user,
client-id), with or without a quota, and every throttle under the quota key that decided it.
Without them that costs one attribute test per charge.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .capacity import CapacityManager
from .connection_quotas import ConnectionQuotas, IpBucketUsage
from .controller_mutation import CONTROLLER_QUOTA_WINDOW, ControllerMutationQuotaManager, MutationVerdict
from .entity import BucketKey, QuotaEntity
from .fleet import MAX_PENDING_PRODUCER_IDS, PeerUsage, UsageEntry
from .manager import DEFAULT_MAX_BUCKETS, EXPIRY_BUDGET, Charge, ClientQuotaManager
from .producer_ids import DEFAULT_PID_WINDOW_MS, DEFAULT_PID_WINDOW_SAMPLES, ProducerIdTracker
from .rate import DEFAULT_WINDOW, WindowConfig
from .shadow import ShadowLog, ShadowPolicy
from .token_bucket import KAFKA, QUOTA_SHAPES, SMOOTH, QuotaShape
from .types import CAPACITY_STREAMS, CapacityStream, ConfigKey, EntitySetting, QuotaType, UsageKind
from .usage import UsageAccount

#: quota values and settings per entity, as configured (`{entity: {QuotaType.PRODUCE: 1024.0,
#: EntitySetting.SHARE: 3.0, ...}}`)
QuotaTable = dict[QuotaEntity, dict[ConfigKey, float]]

#: the directions the hot path charges a capacity with (a module name: an enum member's lookup on
#: its class costs a Python call)
_CAPACITY_PRODUCE = QuotaType.PRODUCE
_CAPACITY_FETCH = QuotaType.FETCH


@dataclass(frozen=True, slots=True)
class EngineConfig:
    window: WindowConfig = DEFAULT_WINDOW
    pid_window: WindowConfig = field(
        default_factory=lambda: WindowConfig(DEFAULT_PID_WINDOW_SAMPLES, DEFAULT_PID_WINDOW_MS))
    pid_filter_capacity: int = 10_000
    pid_false_positive_rate: float = 0.01
    #: users whose producer ids are tracked at once (each holds at most MAX_LAYERS Bloom filters)
    pid_max_users: int = 1000
    #: live buckets per quota type (see manager.py: past it, new `<default>` buckets overflow
    #: into one shared bucket); None only for tests and tools
    max_buckets: int | None = DEFAULT_MAX_BUCKETS
    #: "kafka" (Kafka's windowed rate decides, the default) or "smooth" (a token bucket with a
    #: one-second burst decides the byte-rate and request-time quotas; see token_bucket.py)
    quota_shape: QuotaShape = KAFKA
    #: Kafka's controller.quota.window.num x controller.quota.window.size.seconds: the controller
    #: mutation quota's burst is this many seconds of quota
    controller_window: WindowConfig = CONTROLLER_QUOTA_WINDOW
    #: the proxy's `max_throttle_time_ms` (Redpanda's max_kafka_throttle_delay_ms): no throttle of a
    #: quota or of the capacity goes above it, so no mute or held response does; None: no cap, as
    #: in Kafka. Usage still counts in full, so a client over its quota is throttled again, at
    #: most this long each time, until its rate is back under.
    max_throttle_ms: int | None = None
    #: the proxy's `[proxy] shadow`: every decision is computed and reported, none applied (shadow.py)
    shadow: bool = False

    def __post_init__(self) -> None:
        if self.quota_shape not in QUOTA_SHAPES:
            raise ValueError(
                f"quota_shape must be one of {', '.join(QUOTA_SHAPES)}, got {self.quota_shape!r}")
        if self.max_buckets is not None and self.max_buckets < 1:
            raise ValueError(f"max_buckets must be at least 1, got {self.max_buckets}")
        if self.pid_max_users < 1:
            raise ValueError(f"pid_max_users must be at least 1, got {self.pid_max_users}")
        if self.max_throttle_ms is not None and self.max_throttle_ms < 1:
            raise ValueError(f"max_throttle_ms must be at least 1, got {self.max_throttle_ms}")


@dataclass(frozen=True, slots=True)
class Verdict:
    throttle_ms: int
    #: The quota whose throttle was largest (None when not throttled).
    quota: QuotaType | None = None
    #: A throttled Fetch's records go out all the same (the smooth shape; see QuotaEngine.charge);
    #: False: the response is emptied, as Kafka answers a throttled fetch.
    deliver_fetch: bool = False
    #: The throttle is the cluster capacity's (the tenant is above its fair share), not a quota's;
    #: `quota` then names the direction.
    capacity: bool = False
    #: The throttle was computed and reported, not applied (shadow.py): `throttle_ms` is 0 and
    #: `shadow_ms` is what enforcing would have given.
    shadow_ms: int = 0


NO_THROTTLE = Verdict(0)

#: Kafka API keys (quotas/ does not import protocol/).
_PRODUCE = 0
_FETCH = 1


class QuotaEngine:
    """Kafka's client quota managers side by side, plus the KIP-936 producer-id quota."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        window = config.window
        cap = config.max_buckets
        shape = config.quota_shape
        most = config.max_throttle_ms
        request_most = window.window_ms if most is None else min(window.window_ms, most)
        self.managers: dict[QuotaType, ClientQuotaManager] = {
            QuotaType.PRODUCE: ClientQuotaManager(QuotaType.PRODUCE, window, max_buckets=cap, shape=shape,
                                                  max_throttle_ms=most),
            QuotaType.FETCH: ClientQuotaManager(QuotaType.FETCH, window, max_buckets=cap, shape=shape,
                                                max_throttle_ms=most),
            QuotaType.REQUEST: ClientQuotaManager(QuotaType.REQUEST, window, max_throttle_ms=request_most,
                                                  max_buckets=cap, shape=shape),
            QuotaType.PRODUCER_IDS: ClientQuotaManager(QuotaType.PRODUCER_IDS, config.pid_window,
                                                       max_buckets=cap, max_throttle_ms=most),
        }
        #: KIP-599's token buckets: kept apart from `managers`, whose windowed rates the fleet
        #: exchanges, because a token bucket travels as running totals (see controller_mutation.py)
        self.controller_mutation = ControllerMutationQuotaManager(config.controller_window, max_buckets=cap,
                                                                  max_throttle_ms=most)
        #: partitions a CreateTopics topic asking for the broker's default (-1) is charged before its
        #: answer says how many it got: Kafka's num.partitions default (1) until an answer tells
        self.default_partitions = 1
        self.producer_ids = ProducerIdTracker(config.pid_window.window_ms, config.pid_filter_capacity,
                                              config.pid_false_positive_rate, config.pid_max_users)
        #: KIP-612: connection-creation rates and open connections per client address
        self.connections = ConnectionQuotas(window, max_buckets=cap)
        #: the cluster capacity shared by `share` (idle until `capacity.configure`)
        self.capacity = (CapacityManager(window, max_throttle_ms=most) if cap is None
                         else CapacityManager(window, max_tenants=cap, max_throttle_ms=most))
        #: the (user, client-id) entities in force: what the client quota managers enforce
        self.table: QuotaTable = {}
        #: every entity in force, `ip` ones included: what the admin API describes and changes
        self.configured: QuotaTable = {}
        #: each entity setting's entities in force (resolved with Kafka's precedence where read)
        self.settings: dict[EntitySetting, dict[QuotaEntity, float]] = {
            setting: {} for setting in EntitySetting}
        self._expiry_turn = 0
        #: the fleet's merged peer usage (None: a lone proxy)
        self.fleet: PeerUsage | None = None
        #: producer ids first seen here since the last `take_new_producer_ids` (with a fleet only)
        self._new_producer_ids: list[tuple[str, int]] = []
        #: the usage events' sums (None: usage events off, the default); set by the I/O layer
        self.usage: UsageAccount | None = None
        #: who is in shadow (the whole proxy or entities setting `shadow`), and what they would have got
        self.shadow = ShadowPolicy(config.shadow)
        self.shadow_log = ShadowLog()

    def set_quotas(self, table: QuotaTable) -> None:
        """Apply a new configuration; buckets whose key is unchanged keep their history. The `ip`
        entities go to the connection quotas (every live IP bucket takes its new bound at once)."""
        self.configured = {entity: dict(values) for entity, values in table.items()}
        self.table = {entity: values for entity, values in self.configured.items() if entity.ip is None}
        for quota_type, manager in self.all_managers().items():
            manager.set_quotas({entity: values[quota_type] for entity, values in self.table.items()
                                if quota_type in values
                                and not (quota_type.user_only and entity.client_id is not None)})
        self.connections.set_ip_quotas({entity.ip: values[QuotaType.CONNECTION_CREATION]
                                        for entity, values in table.items()
                                        if entity.ip is not None and QuotaType.CONNECTION_CREATION in values})
        self.settings = {setting: {entity: values[setting] for entity, values in self.table.items()
                                   if setting in values}
                         for setting in EntitySetting}
        self.capacity.set_shares(self.settings[EntitySetting.SHARE])
        self.shadow.set_entities(self.settings[EntitySetting.SHADOW])

    def all_managers(self) -> dict[QuotaType, ClientQuotaManager]:
        """Every quota type's manager: `managers` and the controller mutation quota's."""
        return {**self.managers, QuotaType.CONTROLLER_MUTATION: self.controller_mutation}

    # -- what the proxy asks before forwarding ----------------------------------------------------

    def wants_producer_ids(self, user: str) -> bool:
        """Whether Produce requests of `user` must be opened to read their producer ids.

        Only where a producer_ids_rate quota applies, usage events or not: the seen-before test
        costs tens of microseconds per request, so the events count new producer ids only there.
        """
        if not self.table:
            return False
        return self.managers[QuotaType.PRODUCER_IDS].resolve(user, "") is not None

    def fetch_max_bytes(self, user: str, client_id: str) -> int | None:
        """Kafka lowers a consumer's fetch size to what its quota allows in one full window."""
        if not self.table or (self.shadow.active and self.shadow.shadowed(user, client_id)):
            return None
        cap = self.managers[QuotaType.FETCH].max_value_in_window(user, client_id)
        return None if cap is None else max(1, int(cap))

    def hold_ms(self, user: str, client_id: str, api_key: int, now_ms: int) -> int:
        """How long a request must wait because its bucket is throttled on another connection.

        A broker holds a throttled client by not reading its connection; the proxy fronts the
        whole cluster, so a client's other connections (one per broker) must wait too, or each
        of them would slip one more request past the quota. Produce waits for the produce and
        producer-id buckets, Fetch for the fetch bucket, and every request for the request quota.
        """
        capacity = self.capacity
        if capacity.throttled_until_ms > now_ms:
            wait = capacity.remaining_throttle_ms(QuotaType.REQUEST, user, client_id, now_ms)
            if api_key in (_PRODUCE, _FETCH):
                direction = QuotaType.PRODUCE if api_key == _PRODUCE else QuotaType.FETCH
                wait = max(wait, capacity.remaining_throttle_ms(direction, user, client_id, now_ms))
        else:
            wait = 0
        if self.table:
            managers = self.managers
            wait = max(wait, managers[QuotaType.REQUEST].remaining_throttle_ms(user, client_id, now_ms))
            if api_key == _PRODUCE:
                wait = max(wait, managers[QuotaType.PRODUCE].remaining_throttle_ms(user, client_id, now_ms),
                           managers[QuotaType.PRODUCER_IDS].remaining_throttle_ms(user, "", now_ms))
            elif api_key == _FETCH:
                wait = max(wait, managers[QuotaType.FETCH].remaining_throttle_ms(user, client_id, now_ms))
        if wait and self.shadow.active and self.shadow.shadowed(user, client_id):
            return 0  # in shadow nothing waits (asked only when something would: the hot path)
        return wait

    # -- charging -----------------------------------------------------------------------------

    def charge(self, user: str, client_id: str, now_ms: int, *, produce_bytes: int = 0,
               fetch_bytes: int = 0, request_time_ms: float | None = None,
               producer_ids: Sequence[int] = (), api_key: int | None = None) -> Verdict:
        """Record one request's usage on every quota that applies; return the throttle.

        `api_key` is the API of the request this charge counts in the usage events (None when the
        request was counted by an earlier charge, as a Produce's response after its arrival).
        """
        usage = self.usage
        capacity = self.capacity if self.capacity.active else None
        if not self.table and capacity is None:
            if usage is not None:
                usage.record(user, client_id, api_key, produce_bytes, fetch_bytes, request_time_ms)
            return NO_THROTTLE
        managers = self.managers
        new = 0
        # The worst violated quota so far (a tie goes to the request quota), and the fetch
        # recording to take back if anything throttles.
        worst: Charge | None = None
        worst_type: QuotaType | None = None
        fetch_charge: Charge | None = None
        # the capacity's largest throttle and its direction
        by_capacity = 0
        capacity_type: QuotaType | None = None
        if produce_bytes:
            charge = managers[QuotaType.PRODUCE].record(user, client_id, produce_bytes, now_ms)
            if charge.throttle_ms > 0:
                worst, worst_type = charge, QuotaType.PRODUCE
            if capacity is not None:
                by_capacity = capacity.record(_CAPACITY_PRODUCE, user, client_id, produce_bytes,
                                              charge.bound if charge.bucket is not None else None,
                                              now_ms).throttle_ms
                if by_capacity:
                    capacity_type = _CAPACITY_PRODUCE
        fetch_in_debt = True
        if fetch_bytes:
            charge = fetch_charge = managers[QuotaType.FETCH].record(user, client_id, fetch_bytes, now_ms)
            if charge.throttle_ms > 0 and (worst is None or charge.throttle_ms > worst.throttle_ms):
                worst, worst_type = charge, QuotaType.FETCH
            if capacity is not None:
                fetched = capacity.record(_CAPACITY_FETCH, user, client_id, fetch_bytes,
                                          charge.bound if charge.bucket is not None else None, now_ms)
                fetch_in_debt = fetched.in_debt
                throttle = fetched.throttle_ms
                if throttle > by_capacity:
                    by_capacity, capacity_type = throttle, _CAPACITY_FETCH
        if producer_ids:
            if self.fleet is None:
                new = self.producer_ids.new_ids(user, list(producer_ids), now_ms)
            else:
                fresh = self.producer_ids.new_id_list(user, list(producer_ids), now_ms)
                new = len(fresh)
                if fresh and len(self._new_producer_ids) < MAX_PENDING_PRODUCER_IDS:
                    self._new_producer_ids.extend((user, pid) for pid in fresh)
            if new:
                charge = managers[QuotaType.PRODUCER_IDS].record(user, "", new, now_ms)
                if charge.throttle_ms > 0 and (worst is None or charge.throttle_ms > worst.throttle_ms):
                    worst, worst_type = charge, QuotaType.PRODUCER_IDS
        if request_time_ms is not None:
            # Kafka charges request time as a percentage of one thread: ms * 100 / 1000 per second.
            charge = managers[QuotaType.REQUEST].record(user, client_id, request_time_ms / 10.0, now_ms)
            if charge.throttle_ms > 0 and (worst is None or charge.throttle_ms >= worst.throttle_ms):
                worst, worst_type = charge, QuotaType.REQUEST
            if capacity is not None:
                throttle = capacity.record(QuotaType.REQUEST, user, client_id, request_time_ms / 10.0,
                                           charge.bound if charge.bucket is not None else None,
                                           now_ms).throttle_ms
                if throttle > by_capacity:
                    by_capacity, capacity_type = throttle, QuotaType.REQUEST
        if usage is not None:
            usage.record(user, client_id, api_key, produce_bytes, fetch_bytes, request_time_ms, new)
        if capacity_type is not None and (worst is None or by_capacity > worst.throttle_ms):
            return self._capacity_verdict(user, client_id, capacity_type, by_capacity,
                                          fetch_charge if fetch_in_debt else None, fetch_bytes, now_ms)
        if worst is None or worst_type is None:
            return NO_THROTTLE
        if self.shadow.active and self.shadow.shadowed(user, client_id):
            # the same throttle, recorded as a shadow one; the fetch keeps its records and charge
            managers[worst_type].record_throttle(worst, worst.throttle_ms, now_ms, shadow=True)
            if usage is not None:
                usage.throttled(user, client_id, worst_type, worst.throttle_ms, shadow=True)
            self.shadow_log.add(user, client_id, worst_type.value, worst.throttle_ms)
            self._unthrottle(user, client_id)
            return Verdict(0, worst_type, shadow_ms=worst.throttle_ms)
        managers[worst_type].record_throttle(worst, worst.throttle_ms, now_ms)
        if usage is not None:
            usage.throttled(user, client_id, worst_type, worst.throttle_ms)
        deliver = False
        if fetch_charge is not None:
            # Kafka answers a throttled fetch without records and takes its bytes back, yet its
            # throttle counted them: a response that crosses the quota costs the consumer twice
            # (half its quota with 1 MiB fetches against 1 MB/s). In the smooth shape a fetch that
            # finds its token bucket out of debt is delivered and paid back by the throttle, as a
            # produce is, and the token bucket holds the long-run rate to the quota whatever the
            # response sizes. Only one that finds the bucket in debt (sent on another connection
            # during the throttle) is emptied and taken back.
            deliver = self.config.quota_shape == SMOOTH and not fetch_charge.in_debt
            if not deliver:
                self._take_back_fetch(user, client_id, fetch_charge, fetch_bytes, now_ms, not fetch_in_debt)
        return Verdict(worst.throttle_ms, worst_type, deliver)

    def _capacity_verdict(self, user: str, client_id: str, direction: QuotaType, throttle_ms: int,
                          empty_fetch: Charge | None, fetch_bytes: int, now_ms: int) -> Verdict:
        """The capacity's throttle won: count it apart from the quotas' (its own counters and
        usage-event key). A fetch (`empty_fetch`) whose tenant's bucket was already in debt is
        emptied and taken back, as Kafka does for a quota; one that found the bucket out of
        debt is delivered and paid back by its throttle (see CapacityCharge.in_debt)."""
        if self.shadow.active and self.shadow.shadowed(user, client_id):
            self.capacity.record_throttle(direction, user, client_id, throttle_ms, shadow=True)
            if self.usage is not None:
                self.usage.capacity_throttled(user, client_id, direction, throttle_ms, shadow=True)
            self.shadow_log.add(user, client_id, f"capacity {direction.value}", throttle_ms)
            self._unthrottle(user, client_id)
            return Verdict(0, direction, capacity=True, shadow_ms=throttle_ms)
        self.capacity.record_throttle(direction, user, client_id, throttle_ms)
        if self.usage is not None:
            self.usage.capacity_throttled(user, client_id, direction, throttle_ms)
        if empty_fetch is not None:
            self._take_back_fetch(user, client_id, empty_fetch, fetch_bytes, now_ms, False)
        return Verdict(throttle_ms, direction, empty_fetch is None and fetch_bytes > 0, True)

    def _unthrottle(self, user: str, client_id: str) -> None:
        """A shadow throttle holds nothing, now or after a switch to enforce (hold_ms reads these)."""
        for quota_type, manager in self.managers.items():
            manager.unthrottle(user, "" if quota_type.user_only else client_id)
        if self.capacity.active:
            self.capacity.unthrottle(user, client_id)

    def _take_back_fetch(self, user: str, client_id: str, charge: Charge, fetch_bytes: int,
                         now_ms: int, capacity_tokens: bool) -> None:
        """A throttled fetch answered empty: its bytes count nowhere (Kafka un-records them);
        `capacity_tokens`: the capacity's bucket was charged for it too."""
        self.managers[QuotaType.FETCH].unrecord(charge, fetch_bytes, now_ms)
        if self.capacity.active:
            self.capacity.unrecord(QuotaType.FETCH, user, client_id, fetch_bytes, now_ms, capacity_tokens)
        if self.usage is not None:
            self.usage.unrecord_fetch(user, client_id, fetch_bytes)

    # -- controller mutations (KIP-599) --------------------------------------------------------

    def wants_mutation_costs(self, user: str, client_id: str) -> bool:
        """Whether CreateTopics, CreatePartitions and DeleteTopics of (user, client_id) are charged."""
        return bool(self.table) and self.controller_mutation.resolve(user, client_id) is not None

    def charge_mutations(self, user: str, client_id: str, costs: Sequence[int], strict: bool,
                         now_ms: int) -> MutationVerdict:
        """Charge one mutation request's topics (partitions each, in order); see controller_mutation.py."""
        if self.shadow.active and self.shadow.shadowed(user, client_id):
            # every topic goes ahead in shadow, so every topic is charged, as a non-strict request's are
            verdict = self.controller_mutation.charge_topics(user, client_id, costs, False, now_ms,
                                                             shadow=True)
            if verdict.throttle_ms > 0:
                if self.usage is not None:
                    self.usage.throttled(user, client_id, QuotaType.CONTROLLER_MUTATION, verdict.throttle_ms,
                                         shadow=True)
                self.shadow_log.add(user, client_id, QuotaType.CONTROLLER_MUTATION.value, verdict.throttle_ms)
            return MutationVerdict(verdict.accepted, 0)
        verdict = self.controller_mutation.charge_topics(user, client_id, costs, strict, now_ms)
        if verdict.throttle_ms > 0 and self.usage is not None:
            self.usage.throttled(user, client_id, QuotaType.CONTROLLER_MUTATION, verdict.throttle_ms)
        return verdict

    def quotas_for(self, user: str, client_id: str) -> dict[QuotaType, float]:
        """The quota values in force for (user, client_id), resolved as every charge resolves them."""
        if not self.table:
            return {}
        found: dict[QuotaType, float] = {}
        for quota_type, manager in self.all_managers().items():
            resolved = manager.resolve(user, "" if quota_type.user_only else client_id)
            if resolved is not None:
                found[quota_type] = resolved[1]
        return found

    def settle_mutations(self, user: str, client_id: str, partitions: int, now_ms: int) -> None:
        """Correct a mutation charge by what the broker's answer says was really done."""
        self.controller_mutation.settle(user, client_id, partitions, now_ms)

    def note_default_partitions(self, partitions: int) -> None:
        """A CreateTopics answer showed what a topic asking for the default (-1) got."""
        if partitions > 0:
            self.default_partitions = partitions

    # -- the fleet --------------------------------------------------------------------------------

    def attach_fleet(self, peers: PeerUsage, on_urgent: Callable[[], None] | None = None) -> None:
        """Decide from now on with the fleet's usage: a bucket's own rate plus `peers`' rates.

        `on_urgent` is called from the hot path (at most once per quota type between two
        `local_usage` calls) when a bucket's own rate rose by more than URGENT_CHANGE_RATIO of its
        bound since it was last listed: the exchange should then send `urgent_usage` at once (no
        sooner than URGENT_MIN_INTERVAL_MS after the previous urgent report). It must not do I/O.
        """
        self.fleet = peers
        self.capacity.attach_fleet(peers)
        for quota_type, manager in self.managers.items():
            manager.attach_fleet(peers.view(quota_type), on_urgent)
        # the controller mutation buckets travel as running totals (a TOTAL stream: see
        # controller_mutation.py and fleet_streams.py)
        self.controller_mutation.attach_counts(on_urgent)
        peers.ledger(QuotaType.CONTROLLER_MUTATION).on_debit = self.controller_mutation.peer_charged
        ip_view = peers.view(QuotaType.CONNECTION_CREATION)
        self.connections.attach_peers(lambda bucket, now_ms: ip_view.rate(("", bucket), now_ms), on_urgent)

    def local_usage(self, now_ms: int, changed_only: bool = False) -> list[UsageEntry]:
        """Every live bucket's own rate, for a full report; `changed_only` for a delta report:
        buckets charged or throttled since the previous delta listing whose rate moved by more than
        DELTA_CHANGE_OF_BOUND of their bound (see ClientQuotaManager.local_usage)."""
        usage: list[UsageEntry] = []
        for manager in self.managers.values():
            usage += manager.local_usage(now_ms, changed_only)
        usage += self.controller_mutation.count_usage(changed_only=changed_only)
        charged = self.connections.take_charged() if changed_only else None
        usage += self._ip_buckets(self.connections.ip_usage(now_ms, charged))
        if self.capacity.active:
            usage += self.capacity.local_usage(now_ms, changed_only)
            usage += self.capacity.factor_usage()
        return usage

    @staticmethod
    def _ip_buckets(buckets: Sequence[IpBucketUsage]) -> list[UsageEntry]:
        """IP buckets as fleet entries: quota type CONNECTION_CREATION, keyed ("", bucket)."""
        return [UsageEntry(QuotaType.CONNECTION_CREATION, "", bucket.bucket, bucket.rate)
                for bucket in buckets]

    def full_listing(self) -> list[tuple[UsageKind, list[BucketKey]]]:
        """What a full report lists, per quota type, taken at once; the I/O layer measures it with
        `list_usage` a slice at a time, serving connections in between (measuring 10,000
        buckets in one go holds the event loop for tens of ms)."""
        listing = [(quota_type, manager.begin_full_listing())
                   for quota_type, manager in self.managers.items()]
        listing.append((QuotaType.CONTROLLER_MUTATION, self.controller_mutation.begin_count_listing()))
        ip_keys = [BucketKey("", bucket) for bucket in self.connections.buckets]
        capacity: list[tuple[UsageKind, list[BucketKey]]] = [
            (CAPACITY_STREAMS[direction], list(state.flows))
            for direction, state in self.capacity.directions.items()]
        if self.capacity.factor_usage():
            capacity.append((CapacityStream.CAPACITY_FACTOR, [BucketKey("", "")]))
        return [*listing, (QuotaType.CONNECTION_CREATION, ip_keys), *capacity]

    def list_usage(self, quota_type: UsageKind, keys: Sequence[BucketKey], now_ms: int) -> list[UsageEntry]:
        """Measure and list a slice of `full_listing`'s buckets."""
        if quota_type is QuotaType.CONNECTION_CREATION:
            return self._ip_buckets(self.connections.ip_usage(now_ms, [key.client_id for key in keys]))
        if quota_type is QuotaType.CONTROLLER_MUTATION:
            return self.controller_mutation.count_usage(keys)
        if isinstance(quota_type, CapacityStream):
            if quota_type is CapacityStream.CAPACITY_FACTOR:
                return self.capacity.factor_usage()
            return self.capacity.list_flows(quota_type, keys, now_ms)
        return self.managers[quota_type].list_usage(keys, now_ms)

    def urgent_usage(self, now_ms: int) -> list[UsageEntry]:
        """What an urgent report sends: the buckets whose rise asked for it (see attach_fleet)."""
        usage: list[UsageEntry] = []
        for manager in self.managers.values():
            usage += manager.urgent_usage(now_ms)
        usage += self.controller_mutation.count_usage(changed_only=True)
        return usage + self._ip_buckets(self.connections.urgent_ip_usage(now_ms))

    def take_new_producer_ids(self) -> list[tuple[str, int]]:
        """(user, producer id) first seen here since the last call, for peers to learn."""
        new, self._new_producer_ids = self._new_producer_ids, []
        return new

    def learn_producer_ids(self, user: str, pids: Sequence[int], now_ms: int) -> None:
        """Remember ids a peer saw first, without counting them: if they come here later, they
        count nowhere again (KIP-936 counts an id once, and the fleet is one quota)."""
        self.producer_ids.new_id_list(user, list(pids), now_ms)

    # -- what the I/O layer runs and exports -------------------------------------------------------

    def expire_idle(self, now_ms: int, budget: int = EXPIRY_BUDGET) -> int:
        """Drop quota state no decision needs any more; returns how many buckets went.

        Call it about once a second from the event loop: buckets then go within a second or
        two of their rate's expiry (11 s after their last charge by default), dormant ones
        an hour after it, and producer-id filters of users whose layers all expired. At most
        `budget` buckets and users are examined per call (a few ms at most, however many
        exist); what is left waits for the next call, and the bucket cap never waits for it.
        """
        managers = list(self.all_managers().values())
        # each call starts with the next quota type, so a backlog in one never starves the others
        self._expiry_turn = (self._expiry_turn + 1) % len(managers)
        dropped = 0
        for manager in managers[self._expiry_turn:] + managers[:self._expiry_turn]:
            gone, examined = manager.sweep(now_ms, budget)
            dropped += gone
            budget -= examined
            if budget <= 0:
                return dropped
        self.producer_ids.expire(now_ms, budget)
        return dropped + self.connections.expire_idle(now_ms, budget)

    def bucket_counts(self) -> dict[QuotaType, int]:
        """Live buckets per quota type (dormant and overflow ones included)."""
        return {quota_type: len(manager.buckets) for quota_type, manager in self.managers.items()}

    def overflow_counts(self) -> dict[QuotaType, int]:
        """Charges per quota type that went to the shared overflow bucket (a counter)."""
        return {quota_type: manager.overflow_charges for quota_type, manager in self.managers.items()}
