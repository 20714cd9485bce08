"""Redpanda's client-id prefix entities (issue 28, part 3): where they sit among Kafka's eight
levels, the longest prefix winning, one shared bucket per prefix, and every source and codec
that carries them (the file, the admin API, ZooKeeper paths, quota records, the fleet datagram,
the metrics label, `share`)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from config.admin import INVALID_REQUEST, NONE, describe, entity_parts, plan_alter
from config.config_form import entity_for_path, entity_path
from config.quota_records import QuotaLog, quota_record, record_key
from config.quotas import QuotaConfigError, parse_quotas
from config.store import render
from protocol.apis import ApiKey
from protocol.client_quotas import (
    MATCH_DEFAULT,
    MATCH_EXACT,
    MATCH_SPECIFIED,
    AlterEntry,
    AlterQuotas,
    DescribedEntry,
    DescribeQuotas,
    FilterComponent,
    QuotaOp,
    decode_quota_admin_request,
    describe_quotas_response,
)
from protocol.headers import encode_request_header, parse_request_header
from quotas.capacity import CapacityConfig
from quotas.engine import EngineConfig, QuotaEngine, QuotaTable
from quotas.entity import (
    DEFAULT,
    BucketKey,
    PrefixIndex,
    QuotaEntity,
    bucket_prefix,
    client_id_label,
    prefix_bucket_client_id,
    resolve,
)
from quotas.fleet import PeerUsage, decode_usage, encode_usage
from quotas.manager import ClientQuotaManager
from quotas.rate import WindowConfig
from quotas.types import EntitySetting, QuotaType

P, F = QuotaType.PRODUCE, QuotaType.FETCH
USER, CLIENT, PREFIX = "alice", "etl-a", "etl-"
SHARED = prefix_bucket_client_id(PREFIX)


def prefix_entity(user: str | None, prefix: str) -> QuotaEntity:
    return QuotaEntity(user, None, None, prefix)


# -- precedence: the eleven levels -----------------------------------------------------------------

#: (entity, bucket key it gives alice/etl-a), most specific first: Kafka's eight levels with the
#: prefix levels where Redpanda's documentation puts them (2, 6, 10)
LEVELS = [
    (QuotaEntity(USER, CLIENT), BucketKey(USER, CLIENT)),
    (prefix_entity(USER, PREFIX), BucketKey(USER, SHARED)),
    (QuotaEntity(USER, DEFAULT), BucketKey(USER, CLIENT)),
    (QuotaEntity(USER, None), BucketKey(USER, "")),
    (QuotaEntity(DEFAULT, CLIENT), BucketKey(USER, CLIENT)),
    (prefix_entity(DEFAULT, PREFIX), BucketKey(USER, SHARED)),
    (QuotaEntity(DEFAULT, DEFAULT), BucketKey(USER, CLIENT)),
    (QuotaEntity(DEFAULT, None), BucketKey(USER, "")),
    (QuotaEntity(None, CLIENT), BucketKey("", CLIENT)),
    (prefix_entity(None, PREFIX), BucketKey("", SHARED)),
    (QuotaEntity(None, DEFAULT), BucketKey("", CLIENT)),
]

#: entities that never govern alice/etl-a
OTHERS = {
    prefix_entity("bob", PREFIX): 901.0,
    prefix_entity(USER, "etl-b"): 902.0,
    prefix_entity(None, "etl-ab"): 903.0,  # longer than the client id's match: no match
    prefix_entity(DEFAULT, "x"): 904.0,
    prefix_entity(None, "tl-"): 905.0,  # inside the client id, not its start
    QuotaEntity(None, "etl-"): 906.0,  # the prefix as an exact client id
}


@pytest.mark.parametrize("level", range(len(LEVELS)))
def test_each_level_shadows_the_ones_below(level: int) -> None:
    quotas = {entity: float(index + 1) for index, (entity, _) in enumerate(LEVELS) if index >= level}
    quotas.update(OTHERS)
    assert resolve(quotas, USER, CLIENT) == (LEVELS[level][1], float(level + 1))
    manager = ClientQuotaManager(P, max_buckets=None)
    manager.set_quotas(quotas)
    assert manager.resolve(USER, CLIENT) == (LEVELS[level][1], float(level + 1))


@pytest.mark.parametrize("level", range(len(LEVELS)))
def test_each_level_alone_applies_with_its_bucket_key(level: int) -> None:
    entity, key = LEVELS[level]
    assert resolve({entity: 42.0, **OTHERS}, USER, CLIENT) == (key, 42.0)


def test_exact_beats_prefix_beats_default_at_each_user_level() -> None:
    for user in (USER, DEFAULT, None):
        quotas = {QuotaEntity(user, "etl-c"): 1.0, prefix_entity(user, PREFIX): 2.0,
                  QuotaEntity(user, DEFAULT): 3.0}
        assert resolve(quotas, USER, "etl-c")[1] == 1.0  # type: ignore[index]
        assert resolve(quotas, USER, "etl-a")[1] == 2.0  # type: ignore[index]
        assert resolve(quotas, USER, "app")[1] == 3.0  # type: ignore[index]


def test_a_users_prefix_beats_a_default_users_exact_client_id() -> None:
    """Level 2 above level 5: the user's own entities come before any <default> user's."""
    quotas = {prefix_entity(USER, PREFIX): 1.0, QuotaEntity(DEFAULT, CLIENT): 2.0}
    assert resolve(quotas, USER, CLIENT) == (BucketKey(USER, SHARED), 1.0)
    assert resolve(quotas, "bob", CLIENT) == (BucketKey("bob", CLIENT), 2.0)


def test_prefix_buckets_are_shared_per_level() -> None:
    """User + prefix: one bucket per user; <default> user + prefix: one per user, each user's
    own; prefix alone: one across every user."""
    assert resolve({prefix_entity(USER, PREFIX): 1.0}, USER, "etl-b") == (BucketKey(USER, SHARED), 1.0)
    default_user = {prefix_entity(DEFAULT, PREFIX): 1.0}
    assert resolve(default_user, "bob", "etl-b") == (BucketKey("bob", SHARED), 1.0)
    alone = {prefix_entity(None, PREFIX): 1.0}
    assert resolve(alone, "bob", "etl-b") == resolve(alone, USER, "etl-x") == (BucketKey("", SHARED), 1.0)


def test_the_longest_matching_prefix_wins_within_a_level_never_across_levels() -> None:
    quotas = {prefix_entity(None, "e"): 1.0, prefix_entity(None, "etl-"): 2.0,
              prefix_entity(None, "etl-a"): 3.0}
    assert resolve(quotas, USER, "etl-ab") == (BucketKey("", prefix_bucket_client_id("etl-a")), 3.0)
    assert resolve(quotas, USER, "etl-b") == (BucketKey("", prefix_bucket_client_id("etl-")), 2.0)
    assert resolve(quotas, USER, "ex") == (BucketKey("", prefix_bucket_client_id("e")), 1.0)
    assert resolve(quotas, USER, "x") is None
    # a user's short prefix (level 2) beats the <default> user's longer one (level 6)
    levels = {prefix_entity(USER, "e"): 1.0, prefix_entity(DEFAULT, "etl-a"): 2.0}
    assert resolve(levels, USER, "etl-a") == (BucketKey(USER, prefix_bucket_client_id("e")), 1.0)


prefixes = st.lists(st.text(alphabet="ab-", min_size=1, max_size=5), max_size=8, unique=True)


@settings(max_examples=300, derandomize=True, deadline=None, database=None)
@given(prefixes, st.text(alphabet="ab-", max_size=7))
def test_the_longest_matching_prefix_is_always_chosen(configured: list[str], client_id: str) -> None:
    quotas = {prefix_entity(None, p): float(len(p)) for p in configured}
    matching = [p for p in configured if client_id.startswith(p)]
    found = resolve(quotas, USER, client_id)
    if not matching:
        assert found is None
    else:
        longest = max(matching, key=len)
        assert found == (BucketKey("", prefix_bucket_client_id(longest)), float(len(longest)))
        assert PrefixIndex(quotas).longest(None, client_id) == longest


def test_resolution_is_cached_per_user_and_client_id(monkeypatch: pytest.MonkeyPatch) -> None:
    """Longest-prefix matching runs once per new (user, client-id), not per request."""
    manager = ClientQuotaManager(P, max_buckets=None)
    manager.set_quotas({prefix_entity(None, p): 1000.0 for p in ("a", "etl-", "etl-a", "zz")})
    calls: list[str] = []
    longest = PrefixIndex.longest

    def counted(self: PrefixIndex, user: str | None, client_id: str) -> str | None:
        calls.append(client_id)
        return longest(self, user, client_id)

    monkeypatch.setattr(PrefixIndex, "longest", counted)
    for t in range(100):
        manager.record(USER, "etl-a1", 1, t)
        manager.record(USER, "etl-b", 1, t)
    # one walk per new pair: the user level, the <default> user level, then no user
    assert len(calls) == 6


# -- one shared bucket, through the engine ----------------------------------------------------------


def test_client_ids_under_one_prefix_share_its_quota() -> None:
    """Kafka's 500 B/s vector, the usage split between two client ids of the prefix: the same
    throttle as one client would get (2100 ms); a third id with its exact quota is apart."""
    engine = QuotaEngine(EngineConfig(max_buckets=None))
    engine.set_quotas({prefix_entity(None, PREFIX): {P: 500.0}, QuotaEntity(None, "etl-c"): {P: 10**9}})
    for t in range(0, 10_000, 1000):
        assert engine.charge(USER, "etl-a" if t % 2000 else "etl-b", t, produce_bytes=400).throttle_ms == 0
    assert engine.charge("bob", "etl-c", 10_000, produce_bytes=10**6).throttle_ms == 0
    verdict = engine.charge("bob", "etl-b", 10_500, produce_bytes=2300)
    assert (verdict.throttle_ms, verdict.quota) == (2100, P)
    # etl-a is held for the same bucket's throttle (another connection of the group)
    assert engine.hold_ms(USER, "etl-a", 0, 10_600) > 0
    assert engine.hold_ms(USER, "etl-c", 0, 10_600) == 0
    assert set(engine.managers[P].buckets) == {BucketKey("", SHARED), BucketKey("", "etl-c")}


def test_a_quota_change_keeps_a_prefix_buckets_history() -> None:
    manager = ClientQuotaManager(P, max_buckets=None)
    manager.set_quotas({prefix_entity(USER, PREFIX): 100.0})
    manager.record(USER, "etl-a", 1000, 0)
    bucket = manager.buckets[BucketKey(USER, SHARED)]
    manager.set_quotas({prefix_entity(USER, PREFIX): 200.0, QuotaEntity(None, "x"): 5.0})
    assert manager.buckets[BucketKey(USER, SHARED)] is bucket
    assert (bucket.bound, bucket.applies) == (200.0, True)
    manager.set_quotas({})
    assert not bucket.applies


def test_a_default_users_prefix_buckets_count_against_the_bucket_cap() -> None:
    manager = ClientQuotaManager(P, max_buckets=2)
    manager.set_quotas({prefix_entity(DEFAULT, PREFIX): 100.0})
    for user in ("u1", "u2", "u3"):
        manager.record(user, "etl-a", 1, 0)
    assert manager.overflow_charges == 1


# -- the fleet: a prefix bucket's key travels and merges ---------------------------------------------

SECRET = b"fleet-secret-0123456789abcdef-32"
FLEET = "lkc-prefix"
NOW = 1_700_000_000_000


def test_a_prefix_buckets_usage_travels_through_the_datagram_and_merges_on_the_peer() -> None:
    window = WindowConfig(11, 1000)
    table: QuotaTable = {prefix_entity(None, PREFIX): {P: 500.0}}
    sender, receiver = QuotaEngine(EngineConfig(window=window)), QuotaEngine(EngineConfig(window=window))
    for engine in (sender, receiver):
        engine.set_quotas(table)
    peers = PeerUsage(window.history_ms, own_sender=2)
    receiver.attach_fleet(peers)
    sender.attach_fleet(PeerUsage(window.history_ms, own_sender=1))
    for t in range(0, 10_000, 1000):
        sender.charge(USER, "etl-a", t, produce_bytes=200)
        assert receiver.charge("bob", "etl-b", t, produce_bytes=200).throttle_ms == 0
    usage = sender.local_usage(10_500)
    assert [(e.quota, e.user, e.client_id) for e in usage] == [(P, "", SHARED)]
    (datagram,) = encode_usage(FLEET, 1, 1, NOW, True, usage, [], SECRET)
    report = decode_usage(datagram, SECRET, FLEET, NOW)
    assert [(e.user, e.client_id) for e in report.entries] == [("", SHARED)]
    peers.accept(report, 10_500)
    # both members' 200 B/s over the padded 10.5 s window, then 2300 B: Kafka's 2100 ms vector
    verdict = receiver.charge("bob", "etl-b", 10_500, produce_bytes=2300)
    assert verdict.throttle_ms == 2100


def test_a_peers_prefix_bucket_is_found_by_its_key_for_controller_mutations() -> None:
    engine = QuotaEngine(EngineConfig(max_buckets=None))
    engine.set_quotas({prefix_entity(USER, PREFIX): {QuotaType.CONTROLLER_MUTATION: 10.0}})
    found = engine.controller_mutation.resolve_key(BucketKey(USER, SHARED))
    assert found is not None and (found.bucket, found.bound) == (BucketKey(USER, SHARED), 10.0)


# -- share and the other settings -------------------------------------------------------------------


def test_share_on_a_prefix_makes_its_client_ids_one_tenant_with_that_weight() -> None:
    engine = QuotaEngine(EngineConfig(max_buckets=None))
    engine.set_quotas({prefix_entity(None, PREFIX): {EntitySetting.SHARE: 3.0},
                       prefix_entity(USER, "etl-x"): {EntitySetting.SHARE: 5.0}})
    engine.capacity.configure(CapacityConfig(produce_byte_rate=1000))
    capacity = engine.capacity
    assert capacity.tenant("bob", "etl-a") == capacity.tenant(USER, "etl-b") == (BucketKey("", SHARED), 3.0)
    assert capacity.tenant(USER, "etl-x1") == (BucketKey(USER, prefix_bucket_client_id("etl-x")), 5.0)
    assert capacity.tenant(USER, "app") == (BucketKey(USER, "app"), 1.0)
    # a tenant known by its key only (a peer's) gets the prefix entity's weight
    assert capacity._weight(BucketKey("", SHARED)) == 3.0
    assert capacity._weight(BucketKey(USER, prefix_bucket_client_id("etl-x"))) == 5.0


# -- metrics label --------------------------------------------------------------------------------


def test_a_prefix_buckets_client_id_label_shows_the_prefix() -> None:
    assert client_id_label(SHARED) == "etl-*"
    assert client_id_label("etl-a") == "etl-a"
    assert bucket_prefix(SHARED) == PREFIX
    assert bucket_prefix("etl-*") is None
    assert bucket_prefix("") is None


# -- the quota file -------------------------------------------------------------------------------


def test_the_file_takes_a_prefix_alone_with_a_user_or_with_the_default_user() -> None:
    table = parse_quotas({"quota": [
        {"client_id_prefix": "etl-", "producer_byte_rate": 1000},
        {"user": "alice", "client_id_prefix": "etl-", "consumer_byte_rate": 2000, "share": 2.0},
        {"user": DEFAULT, "client_id_prefix": "etl-", "request_percentage": 50.0},
    ]})
    assert table == {
        prefix_entity(None, PREFIX): {P: 1000.0},
        prefix_entity(USER, PREFIX): {F: 2000.0, EntitySetting.SHARE: 2.0},
        prefix_entity(DEFAULT, PREFIX): {QuotaType.REQUEST: 50.0},
    }
    assert parse_quotas(_toml_tables(render(table))) == table


def _toml_tables(text: str) -> dict[str, object]:
    import tomllib
    return tomllib.loads(text)


@pytest.mark.parametrize(("table", "says"), [
    ({"client_id_prefix": "", "producer_byte_rate": 1},
     "quota #1: client_id_prefix = '' must be a non-empty string"),
    ({"client_id_prefix": "etl-", "client_id": "etl-a", "producer_byte_rate": 1},
     "quota #1: client_id_prefix = 'etl-' cannot be combined with client_id = 'etl-a'"),
    ({"client_id_prefix": "etl-", "ip": "10.0.0.1", "connection_creation_rate": 1},
     "quota #1: ip = '10.0.0.1' cannot be combined with user, client_id or client_id_prefix"),
    ({"client_id_prefix": DEFAULT, "producer_byte_rate": 1},
     "quota #1: client_id_prefix = '<default>': a prefix has no default entity"),
    ({"client_id_prefix": 7, "producer_byte_rate": 1},
     "quota #1: client_id_prefix = 7 must be a non-empty string"),
    ({"user": "alice", "client_id_prefix": "etl-", "producer_ids_rate": 1},
     "quota for user=alice, client-id-prefix=etl-: producer_ids_rate = 1 applies to user entities only"),
    ({"client_id_prefix": "etl-", "connection_creation_rate": 1},
     "client-id-prefix=etl-: connection_creation_rate = 1 is not a quota of user and client-id entities"),
])
def test_bad_prefix_tables_are_refused_naming_table_key_and_value(table: dict[str, object],
                                                                  says: str) -> None:
    with pytest.raises(QuotaConfigError) as caught:
        parse_quotas({"quota": [table]})
    assert says in str(caught.value)


# -- ZooKeeper paths and quota records ------------------------------------------------------------


@pytest.mark.parametrize(("entity", "path"), [
    (prefix_entity(None, "etl-"), "client-id-prefix/etl-"),
    (prefix_entity("alice", "etl-"), "users/alice/client-id-prefix/etl-"),
    (prefix_entity(DEFAULT, "etl-"), "users/<default>/client-id-prefix/etl-"),
    (prefix_entity("CN=a b", "etl/x "), "users/CN%3Da%20b/client-id-prefix/etl%2Fx%20"),
    (prefix_entity(None, DEFAULT), "client-id-prefix/%3Cdefault%3E"),  # never the default
])
def test_prefix_entity_paths_round_trip(entity: QuotaEntity, path: str) -> None:
    assert entity_path(entity) == path
    assert entity_for_path(path) == entity


@pytest.mark.parametrize("path", ["client-id-prefix/", "users/alice/client-id-prefix/", "client-id-prefix",
                                  "client-id-prefix/<default>", "users/<default>/client-id-prefix/<default>"])
def test_an_empty_or_default_prefix_path_is_not_an_entity(path: str) -> None:
    with pytest.raises(ValueError):
        entity_for_path(path)


def test_a_prefix_entity_is_a_quota_record_keyed_by_its_path() -> None:
    key = record_key(b"a fleet secret of 32 bytes......")
    log = QuotaLog(key)
    entity = prefix_entity("alice", "etl-")
    record = quota_record(entity, {P: 1000.0, EntitySetting.SHARE: 2.0}, key, 1_800_000_000_000)
    assert record.key == b"users/alice/client-id-prefix/etl-"
    assert log.apply(0, record.key, record.value, list(record.headers)) is None
    assert log.table() == {entity: {P: 1000.0, EntitySetting.SHARE: 2.0}}


# -- the admin API ----------------------------------------------------------------------------------

TABLE: QuotaTable = {
    prefix_entity(None, "etl-"): {P: 1000.0},
    prefix_entity("alice", "etl-"): {P: 2000.0},
    QuotaEntity(None, "etl-"): {P: 3000.0},
    QuotaEntity("alice", None): {P: 4000.0},
}


def described(*components: tuple[str, int, str | None], strict: bool = False) -> list[object]:
    found = describe(TABLE, DescribeQuotas(tuple(FilterComponent(*c) for c in components), strict))
    return [entry.entity for entry in found]


def test_describe_matches_prefix_entities_exactly_by_default_and_by_any() -> None:
    assert described(("client-id-prefix", MATCH_EXACT, "etl-")) == [
        (("client-id-prefix", "etl-"),), (("user", "alice"), ("client-id-prefix", "etl-"))]
    assert described(("client-id-prefix", MATCH_EXACT, "etl-"), strict=True) == [
        (("client-id-prefix", "etl-"),)]
    # an exact filter names an entity, it does not match client ids by prefix
    assert described(("client-id-prefix", MATCH_EXACT, "etl-a")) == []
    # a prefix has no default entity: nothing matches
    assert described(("client-id-prefix", MATCH_DEFAULT, None)) == []
    assert described(("client-id-prefix", MATCH_SPECIFIED, None), ("user", MATCH_SPECIFIED, None)) == [
        (("user", "alice"), ("client-id-prefix", "etl-"))]
    # a client-id filter never selects a prefix entity, and the other way round
    assert described(("client-id", MATCH_EXACT, "etl-")) == [(("client-id", "etl-"),)]


def test_describe_refuses_a_prefix_filter_with_an_ip_filter() -> None:
    from config.admin import AdminError
    with pytest.raises(AdminError) as caught:
        described(("client-id-prefix", MATCH_SPECIFIED, None), ("ip", MATCH_SPECIFIED, None))
    assert caught.value.code == INVALID_REQUEST


def alteration(*entity: tuple[str, str | None]) -> AlterQuotas:
    return AlterQuotas((AlterEntry(tuple(entity), (QuotaOp("producer_byte_rate", 1000.0, False),)),), False)


def test_alter_sets_a_prefix_alone_and_with_a_user() -> None:
    plan = plan_alter(alteration(("client-id-prefix", "etl-")))
    assert [r.error_code for r in plan.results] == [NONE]
    assert plan.changes == {prefix_entity(None, "etl-"): {P: 1000.0}}
    plan = plan_alter(alteration(("user", None), ("client-id-prefix", "etl-")))
    assert plan.changes == {prefix_entity(DEFAULT, "etl-"): {P: 1000.0}}
    assert entity_parts(prefix_entity(DEFAULT, "etl-")) == (("user", None), ("client-id-prefix", "etl-"))


@pytest.mark.parametrize(("entity", "says"), [
    ((("client-id-prefix", ""),), "Empty client-id-prefix not supported"),
    ((("client-id-prefix", None),), "client-id-prefix has no default entity"),
    ((("client-id-prefix", "etl-"), ("client-id", "etl-a")),
     "client-id-prefix=etl- cannot be combined with client-id=etl-a"),
    ((("client-id-prefix", "etl-"), ("ip", "10.0.0.1")), "IP entity should not be combined"),
    ((("client-id-prefix", "<default>"),), "client_id_prefix = '<default>': a prefix has no default entity"),
])
def test_alter_refuses_bad_prefix_entities_naming_them(entity: tuple[tuple[str, str | None], ...],
                                                       says: str) -> None:
    (result,) = plan_alter(alteration(*entity)).results
    assert result.error_code == INVALID_REQUEST
    assert says in (result.error_message or "")


@pytest.mark.parametrize("version", [0, 1])
def test_the_codecs_carry_the_client_id_prefix_entity_type(version: int) -> None:
    from kafka.protocol.admin.client_quotas import AlterClientQuotasRequest, DescribeClientQuotasResponse

    cls = AlterClientQuotasRequest
    body = cls(validate_only=False, entries=[cls.EntryData(
        entity=[cls.EntryData.EntityData(entity_type="client-id-prefix", entity_name="etl-")],
        ops=[cls.EntryData.OpData(key="producer_byte_rate", value=1000.0, remove=False)])])
    header = encode_request_header(ApiKey.ALTER_CLIENT_QUOTAS, version, 9, "tool")
    raw = header + bytes(body.encode(version=version))
    decoded = decode_quota_admin_request(raw, parse_request_header(raw))
    assert decoded == alteration(("client-id-prefix", "etl-"))
    answer = describe_quotas_response(9, version, [DescribedEntry((("client-id-prefix", "etl-"),),
                                                                  (("producer_byte_rate", 1000.0),))])
    header_size = 4 if version == 0 else 5  # correlation id, plus the tagged fields of a flexible header
    message = DescribeClientQuotasResponse.decode(answer[header_size:], version=version)
    (entry,) = message.entries
    assert [(e.entity_type, e.entity_name) for e in entry.entity] == [("client-id-prefix", "etl-")]
