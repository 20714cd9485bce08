"""The admin quota APIs in pure code: codecs, Kafka's filter matching and validation, the file
store's overlay, and the connection keeping order around a request the proxy answers itself."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from kafka.protocol.admin.client_quotas import (
    AlterClientQuotasRequest,
    AlterClientQuotasResponse,
    DescribeClientQuotasRequest,
    DescribeClientQuotasResponse,
)
from kafka.protocol.consumer import HeartbeatRequest, HeartbeatResponse

from config.admin import (
    INVALID_REQUEST,
    UNSUPPORTED_VERSION,
    AdminError,
    apply_changes,
    describe,
    plan_alter,
)
from config.quotas import QuotaConfigError
from config.store import FileQuotaStore, render
from protocol.apis import ApiKey
from protocol.client_quotas import (
    MATCH_EXACT,
    AlterEntry,
    AlterQuotas,
    AlterResult,
    DescribedEntry,
    DescribeQuotas,
    FilterComponent,
    QuotaOp,
    alter_quotas_response,
    decode_quota_admin_request,
    describe_quotas_response,
)
from protocol.connection import Close, ProxyConnection, QuotaAdmin, ToBroker, ToClient
from protocol.errors import MalformedBody
from protocol.frames import FrameSplitter, frame
from protocol.headers import encode_request_header, parse_request_header
from quotas.engine import QuotaTable
from quotas.entity import DEFAULT, QuotaEntity
from quotas.types import QuotaType

P, F, R, PID = QuotaType.PRODUCE, QuotaType.FETCH, QuotaType.REQUEST, QuotaType.PRODUCER_IDS

TABLE: QuotaTable = {
    QuotaEntity("alice", None): {P: 1024.0},
    QuotaEntity("alice", "etl"): {F: 2048.0},
    QuotaEntity(DEFAULT, None): {R: 50.0},
    QuotaEntity(None, "etl"): {P: 10.0},
    QuotaEntity(None, DEFAULT): {F: 20.0},
}


def request_frame(cls: type, version: int, cid: int, **fields: object) -> bytes:
    key = cls.API_KEY  # type: ignore[attr-defined]
    header = encode_request_header(key, version, cid, "admin-tool")  # v2 for flexible versions
    return header + bytes(cls(**fields).encode(version=version))  # type: ignore[operator]


# -- codecs --------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [0, 1])
def test_describe_request_and_response_round_trip(version: int) -> None:
    C = DescribeClientQuotasRequest.ComponentData
    raw = request_frame(
        DescribeClientQuotasRequest,
        version,
        7,
        strict=True,
        components=[
            C(entity_type="user", match_type=0, match="alice"),
            C(entity_type="client-id", match_type=1, match=None),
        ],
    )
    decoded = decode_quota_admin_request(raw, parse_request_header(raw))
    assert decoded == DescribeQuotas(
        (FilterComponent("user", 0, "alice"), FilterComponent("client-id", 1, None)), True
    )
    answer = describe_quotas_response(
        7,
        version,
        [DescribedEntry((("user", "alice"), ("client-id", None)), (("consumer_byte_rate", 2048.0),))],
    )
    assert answer[:4] == (7).to_bytes(4, "big")
    body = answer[5:] if version >= 1 else answer[4:]  # flexible versions: response header v1
    message = DescribeClientQuotasResponse.decode(body, version=version)
    assert message.error_code == 0
    ((entry,),) = [message.entries]
    assert [(e.entity_type, e.entity_name) for e in entry.entity] == [("user", "alice"), ("client-id", None)]
    assert [(v.key, v.value) for v in entry.values] == [("consumer_byte_rate", 2048.0)]


@pytest.mark.parametrize("version", [0, 1])
def test_alter_request_and_response_round_trip(version: int) -> None:
    E = AlterClientQuotasRequest.EntryData
    raw = request_frame(
        AlterClientQuotasRequest,
        version,
        9,
        validate_only=False,
        entries=[
            E(
                entity=[E.EntityData(entity_type="user", entity_name=None)],
                ops=[
                    E.OpData(key="producer_byte_rate", value=1024.0, remove=False),
                    E.OpData(key="request_percentage", value=0.0, remove=True),
                ],
            )
        ],
    )
    decoded = decode_quota_admin_request(raw, parse_request_header(raw))
    assert decoded == AlterQuotas(
        (
            AlterEntry(
                (("user", None),),
                (QuotaOp("producer_byte_rate", 1024.0, False), QuotaOp("request_percentage", 0.0, True)),
            ),
        ),
        False,
    )
    answer = alter_quotas_response(9, version, [AlterResult((("user", None),), 42, "nope")])
    body = answer[5:] if version >= 1 else answer[4:]
    (entry,) = AlterClientQuotasResponse.decode(body, version=version).entries
    assert (entry.error_code, entry.error_message) == (42, "nope")
    assert [(e.entity_type, e.entity_name) for e in entry.entity] == [("user", None)]


DC = DescribeClientQuotasRequest.ComponentData
AE = AlterClientQuotasRequest.EntryData


def user_entry(**overrides: object) -> object:
    fields: dict[str, object] = {
        "entity": [AE.EntityData(entity_type="user", entity_name="alice")],
        "ops": [AE.OpData(key="producer_byte_rate", value=1.0, remove=False)],
    }
    return AE(**{**fields, **overrides})


# (request class, fields with a null where the schema forbids one, the field the close must name)
NULLS: list[tuple[type, dict[str, object], str]] = [
    (DescribeClientQuotasRequest, {"components": None, "strict": False}, "components"),
    (DescribeClientQuotasRequest,
     {"components": [DC(entity_type=None, match_type=0, match="a")], "strict": False},
     "components[0].entity_type"),
    (AlterClientQuotasRequest, {"entries": None, "validate_only": False}, "entries"),
    (AlterClientQuotasRequest, {"entries": [user_entry(entity=None)], "validate_only": False},
     "entries[0].entity"),
    (AlterClientQuotasRequest, {"entries": [user_entry(ops=None)], "validate_only": False},
     "entries[0].ops"),
    (AlterClientQuotasRequest,
     {"entries": [user_entry(entity=[AE.EntityData(entity_type=None, entity_name="a")])],
      "validate_only": False},
     "entries[0].entity[0].entity_type"),
    (AlterClientQuotasRequest,
     {"entries": [user_entry(ops=[AE.OpData(key=None, value=1.0, remove=False)])], "validate_only": False},
     "entries[0].ops[0].key"),
]


def closed_with(raw: bytes) -> str:
    """Feed one request to a fresh connection; it must close (nothing forwarded, nothing for
    the admin layer) and the reason is returned."""
    conn = ProxyConnection(lambda node: ("proxy", 9000 + node))
    actions = conn.receive_from_client(frame(raw), 0)
    assert [type(a) for a in actions] == [Close], actions
    assert conn.closed is not None and conn.closed == actions[0].reason  # type: ignore[attr-defined]
    return conn.closed


@pytest.mark.parametrize("version", [0, 1])
@pytest.mark.parametrize(("cls", "fields", "path"), NULLS, ids=[path for _, _, path in NULLS])
def test_null_where_the_schema_forbids_it_closes_naming_the_field(
    cls: type, fields: dict[str, object], path: str, version: int
) -> None:
    raw = request_frame(cls, version, 5, **fields)  # kafka-python encodes None as length -1
    with pytest.raises(MalformedBody, match=rf"{re.escape(path)} is null \(length -1\)"):
        decode_quota_admin_request(raw, parse_request_header(raw))
    reason = closed_with(raw)
    assert f"{path} is null" in reason and f"v{version}" in reason


@pytest.mark.parametrize("length", [-2, -5, -(2**31)])
def test_negative_array_length_other_than_null_closes_naming_it(length: int) -> None:
    raw = request_frame(DescribeClientQuotasRequest, 0, 5, components=[], strict=False)
    start = parse_request_header(raw).body_offset
    raw = raw[:start] + length.to_bytes(4, "big", signed=True) + raw[start + 4 :]
    assert f"components has length {length}" in closed_with(raw)


def test_array_longer_than_the_bytes_left_closes_naming_both() -> None:
    raw = request_frame(AlterClientQuotasRequest, 0, 5, entries=[user_entry()], validate_only=False)
    start = parse_request_header(raw).body_offset
    raw = raw[:start] + (1_000_000).to_bytes(4, "big") + raw[start + 4 :]
    left = len(raw) - start - 4
    assert f"entries has length 1000000 but only {left} bytes are left" in closed_with(raw)


def test_string_longer_than_the_bytes_left_closes() -> None:
    raw = request_frame(DescribeClientQuotasRequest, 0, 5, components=[DC(entity_type="user", match_type=0,
                                                                          match="alice")], strict=False)
    start = parse_request_header(raw).body_offset + 4  # the first component's entity type
    raw = raw[:start] + (300).to_bytes(2, "big") + raw[start + 2 :]
    assert "components[0].entity_type has length 300 but only" in closed_with(raw)


def test_nullable_fields_may_still_be_null() -> None:
    raw = request_frame(AlterClientQuotasRequest, 1, 5, validate_only=True, entries=[
        user_entry(entity=[AE.EntityData(entity_type="client-id", entity_name=None)])])
    decoded = decode_quota_admin_request(raw, parse_request_header(raw))
    assert isinstance(decoded, AlterQuotas)
    assert decoded.entries[0].entity == (("client-id", None),)


# -- describe: Kafka's matching ------------------------------------------------------------------


def entities(found: list[DescribedEntry]) -> list[tuple[tuple[str, str | None], ...]]:
    return [entry.entity for entry in found]


def test_describe_everything_when_unfiltered_and_nothing_when_strict() -> None:
    assert len(describe(TABLE, DescribeQuotas((), False))) == 5
    assert describe(TABLE, DescribeQuotas((), True)) == []


def test_describe_exact_default_and_specified() -> None:
    exact = describe(TABLE, DescribeQuotas((FilterComponent("user", 0, "alice"),), False))
    assert entities(exact) == [(("user", "alice"),), (("user", "alice"), ("client-id", "etl"))]
    strict = describe(TABLE, DescribeQuotas((FilterComponent("user", 0, "alice"),), True))
    assert entities(strict) == [(("user", "alice"),)]
    assert strict[0].values == (("producer_byte_rate", 1024.0),)
    default = describe(TABLE, DescribeQuotas((FilterComponent("user", 1, None),), False))
    assert entities(default) == [(("user", None),)]
    # "specified" means the entity has that type, default names included (ClientQuotasImage)
    clients = describe(TABLE, DescribeQuotas((FilterComponent("client-id", 2, None),), True))
    assert entities(clients) == [(("client-id", None),), (("client-id", "etl"),)]
    assert describe(TABLE, DescribeQuotas((FilterComponent("ip", 2, None),), False)) == []


@pytest.mark.parametrize(
    ("components", "code", "says"),
    [
        ((FilterComponent("", 0, "x"),), INVALID_REQUEST, "Invalid empty entity type"),
        (
            (FilterComponent("user", 0, "a"), FilterComponent("user", 2, None)),
            INVALID_REQUEST,
            "more than once",
        ),
        ((FilterComponent("group", 0, "g"),), UNSUPPORTED_VERSION, "Unsupported entity type group"),
        ((FilterComponent("user", 0, None),), INVALID_REQUEST, "MATCH_TYPE_EXACT"),
        ((FilterComponent("user", 1, "a"),), INVALID_REQUEST, "MATCH_TYPE_DEFAULT"),
        ((FilterComponent("user", 2, "a"),), INVALID_REQUEST, "MATCH_TYPE_SPECIFIED"),
        ((FilterComponent("user", 7, None),), INVALID_REQUEST, "Unknown match type 7"),
        ((FilterComponent("ip", 2, None), FilterComponent("user", 2, None)), INVALID_REQUEST, "IP filter"),
    ],
)
def test_describe_refuses_bad_filters(components: tuple[FilterComponent, ...], code: int, says: str) -> None:
    with pytest.raises(AdminError, match=says) as error:
        describe(TABLE, DescribeQuotas(components, False))
    assert error.value.code == code


# -- alter: validation -----------------------------------------------------------------------------


def alteration(
    *entries: tuple[tuple[tuple[str, str | None], ...], tuple[QuotaOp, ...]], validate_only: bool = False
) -> AlterQuotas:
    return AlterQuotas(tuple(AlterEntry(entity, ops) for entity, ops in entries), validate_only)


def test_alter_plans_changes_with_defaults_and_removals() -> None:
    plan = plan_alter(
        alteration(
            ((("user", None), ("client-id", "etl")), (QuotaOp("producer_byte_rate", 100.0, False),)),
            (
                (("user", "alice"),),
                (QuotaOp("producer_byte_rate", 0.0, True), QuotaOp("producer_ids_rate", 2.0, False)),
            ),
        )
    )
    assert [r.error_code for r in plan.results] == [0, 0]
    assert plan.changes == {
        QuotaEntity(DEFAULT, "etl"): {P: 100.0},
        QuotaEntity("alice", None): {P: None, PID: 2.0},
    }
    after = apply_changes(TABLE, plan.changes)
    assert after[QuotaEntity("alice", None)] == {PID: 2.0}
    assert after[QuotaEntity(DEFAULT, "etl")] == {P: 100.0}
    emptied = apply_changes(TABLE, {QuotaEntity("alice", None): {P: None}})
    assert QuotaEntity("alice", None) not in emptied


def test_controller_mutation_rate_is_altered_on_users_client_ids_and_defaults() -> None:
    """KIP-599's key, as Kafka's ClientQuotaControlManager accepts it: a double on any user or
    client-id entity, defaults included."""
    key = "controller_mutation_rate"
    plan = plan_alter(alteration(
        ((("user", "alice"),), (QuotaOp(key, 2.5, False),)),
        ((("client-id", None),), (QuotaOp(key, 10.0, False),)),
        ((("user", None), ("client-id", "etl")), (QuotaOp(key, 1.0, False),)),
    ))
    assert [r.error_code for r in plan.results] == [0, 0, 0]
    assert plan.changes == {
        QuotaEntity("alice", None): {QuotaType.CONTROLLER_MUTATION: 2.5},
        QuotaEntity(None, DEFAULT): {QuotaType.CONTROLLER_MUTATION: 10.0},
        QuotaEntity(DEFAULT, "etl"): {QuotaType.CONTROLLER_MUTATION: 1.0},
    }
    table = apply_changes({}, plan.changes)
    (entry,) = describe(table, DescribeQuotas((FilterComponent("user", MATCH_EXACT, "alice"),), False))
    assert entry.values == ((key, 2.5),)


def test_validate_only_plans_nothing() -> None:
    plan = plan_alter(
        alteration(((("user", "a"),), (QuotaOp("producer_byte_rate", 100.0, False),)), validate_only=True)
    )
    assert [r.error_code for r in plan.results] == [0]
    assert plan.changes == {}


@pytest.mark.parametrize(
    ("entity", "ops", "says"),
    [
        ((("user", "v"),), (QuotaOp("producer_byte_rate", 0.0, False),), "greater than 0"),
        ((("user", "v"),), (QuotaOp("consumer_byte_rate", 1.5, False),), "whole number"),
        ((("user", "v"),), (QuotaOp("nope", 1.0, False),), "unknown quota key nope"),
        ((("user", "v"),), (QuotaOp("nope", 0.0, True),), "Invalid configuration key nope"),
        ((("client-id", "c"),), (QuotaOp("producer_ids_rate", 1.0, False),), "user entities only"),
        (
            (("user", "u"), ("client-id", "c")),
            (QuotaOp("producer_ids_rate", 1.0, False),),
            "user entities only",
        ),
        ((("user", "v"),), (QuotaOp("controller_mutation_rate", 0.0, False),), "greater than 0"),
        ((("user", ""),), (QuotaOp("producer_byte_rate", 1.0, False),), "Empty user not supported"),
        (
            (("user", "a"), ("user", "b")),
            (QuotaOp("producer_byte_rate", 1.0, False),),
            "duplicate entity entry",
        ),
        # KIP-612 ip entities: their own key only, valid addresses or prefixes, never combined
        ((("ip", "1.2.3.4"),), (QuotaOp("producer_byte_rate", 1.0, False),), "not a quota of ip entities"),
        ((("user", "v"),), (QuotaOp("connection_creation_rate", 1.0, False),), "Invalid configuration key"),
        ((("ip", "10.1.2.0/33"),), (QuotaOp("connection_creation_rate", 1.0, False),), "not a valid IP"),
        ((("ip", "10.1.2.3/24"),), (QuotaOp("connection_creation_rate", 1.0, False),), "10.1.2.3/24"),
        ((("ip", "kafka.example"),), (QuotaOp("connection_creation_rate", 1.0, False),), "kafka.example"),
        ((("ip", "1.2.3.4"), ("user", "u")), (QuotaOp("connection_creation_rate", 1.0, False),),
         "IP entity should not be combined"),
        ((("ip", "1.2.3.4"),), (QuotaOp("connection_creation_rate", 2.5, False),), "fractional"),
        ((("ip", None),), (QuotaOp("connection_creation_rate", 0.0, False),), "greater than 0"),
        ((), (QuotaOp("producer_byte_rate", 1.0, False),), "Invalid empty client quota entity"),
        (
            (("user", "v"),),
            (QuotaOp("producer_byte_rate", 1.0, False), QuotaOp("producer_byte_rate", 2.0, False)),
            "Duplicate quota key",
        ),
    ],
)
def test_invalid_entries_are_refused_with_invalid_request(
    entity: tuple[tuple[str, str | None], ...], ops: tuple[QuotaOp, ...], says: str
) -> None:
    plan = plan_alter(
        alteration((entity, ops), ((("user", "good"),), (QuotaOp("producer_byte_rate", 5.0, False),)))
    )
    (bad, good) = plan.results
    assert bad.error_code == INVALID_REQUEST and bad.error_message is not None and says in bad.error_message
    assert good.error_code == 0
    assert plan.changes == {QuotaEntity("good", None): {P: 5.0}}


def test_an_entity_given_twice_is_refused_both_times() -> None:
    ops = (QuotaOp("producer_byte_rate", 5.0, False),)
    plan = plan_alter(alteration(((("user", "twice"),), ops), ((("user", "twice"),), ops)))
    assert [r.error_code for r in plan.results] == [INVALID_REQUEST, INVALID_REQUEST]
    assert plan.changes == {}


# -- the file store ---------------------------------------------------------------------------------


def test_admin_file_overrides_the_quota_file_entity_by_entity(tmp_path: Path) -> None:
    quota_file = tmp_path / "kthrottle.toml"
    quota_file.write_text(
        '[proxy]\n\n[[quota]]\nuser = "alice"\nproducer_byte_rate = 1024\n\n'
        '[[quota]]\nclient_id = "etl"\nconsumer_byte_rate = 2048\n'
    )
    seen: list[QuotaTable] = []
    store = FileQuotaStore(quota_file, seen.append)
    store.start()
    assert store.current() == {QuotaEntity("alice", None): {P: 1024.0}, QuotaEntity(None, "etl"): {F: 2048.0}}
    # removing a key the quota file set: the admin file records the entity as empty
    store.alter({QuotaEntity("alice", None): {P: None}, QuotaEntity("bob", "x y"): {R: 12.5}})
    assert store.current() == {QuotaEntity(None, "etl"): {F: 2048.0}, QuotaEntity("bob", "x y"): {R: 12.5}}
    assert seen[-1] == store.current()
    assert "producer_byte_rate = 1024" in quota_file.read_text()  # the operator's file is untouched
    admin_text = store.admin_file.read_text()
    assert 'user = "alice"' in admin_text and 'client_id = "x y"' in admin_text
    # a fresh store (a restart) reads the same quotas
    again = FileQuotaStore(quota_file, lambda table: None)
    again.start()
    assert again.current() == store.current()


def test_an_invalid_edit_keeps_the_last_good_quotas(tmp_path: Path) -> None:
    quota_file = tmp_path / "q.toml"
    quota_file.write_text('[[quota]]\nuser = "alice"\nproducer_byte_rate = 1024\n')
    store = FileQuotaStore(quota_file, lambda table: None)
    store.start()
    quota_file.write_text('[[quota]]\nuser = "alice"\nproducer_byte_rate = -1\n')
    assert store.poll() is False
    assert store.current() == {QuotaEntity("alice", None): {P: 1024.0}}
    assert store.poll() is False  # not re-read until the file changes again
    quota_file.write_text('[[quota]]\nuser = "alice"\nproducer_byte_rate = 4096\n')
    assert store.poll() is True
    assert store.current() == {QuotaEntity("alice", None): {P: 4096.0}}


def test_invalid_file_at_start_is_an_error_naming_the_value(tmp_path: Path) -> None:
    quota_file = tmp_path / "q.toml"
    quota_file.write_text('[[quota]]\nclient_id = "c"\nconsumer_byte_rate = 1.5\n')
    with pytest.raises(QuotaConfigError, match=r"consumer_byte_rate = 1\.5"):
        FileQuotaStore(quota_file, lambda table: None).start()


def test_render_round_trips_awkward_names(tmp_path: Path) -> None:
    from config.quotas import load_quota_file

    table: QuotaTable = {QuotaEntity('q"uote\\ü😀', DEFAULT): {P: 1e12, R: 0.25}}
    path = tmp_path / "r.toml"
    path.write_text(render(table))
    assert load_quota_file(path) == table


# -- the connection around a request the proxy answers ---------------------------------------------


def heartbeat(cid: int) -> bytes:
    return request_frame(
        HeartbeatRequest, 4, cid, group_id="g", generation_id=1, member_id="m", group_instance_id=None
    )


def heartbeat_answer(cid: int) -> bytes:
    return (
        cid.to_bytes(4, "big")
        + b"\x00"
        + bytes(HeartbeatResponse(throttle_time_ms=0, error_code=0).encode(version=4))
    )


def describe_request(cid: int) -> bytes:
    return request_frame(DescribeClientQuotasRequest, 1, cid, components=[], strict=False)


def ids(frames_out: list[bytes], request_side: bool) -> list[int]:
    if request_side:
        return [parse_request_header(f).correlation_id for f in frames_out]
    return [int.from_bytes(f[:4], "big") for f in frames_out]


def out(actions: list[object], kind: type) -> list[bytes]:
    data = b"".join(b"".join(a.chunks) for a in actions if isinstance(a, kind))  # type: ignore[attr-defined]
    return FrameSplitter(2**31 - 1).feed(data)


def test_admin_answer_keeps_its_place_and_later_requests_wait_for_it() -> None:
    conn = ProxyConnection(lambda node: ("proxy", 9000 + node))
    up = conn.receive_from_client(frame(heartbeat(1)) + frame(describe_request(2)) + frame(heartbeat(3)), 0)
    assert ids(out(up, ToBroker), True) == [1]  # the one behind the admin request waits
    (admin,) = [a for a in up if isinstance(a, QuotaAdmin)]
    assert (admin.correlation_id, admin.api_key, admin.principal) == (
        2,
        ApiKey.DESCRIBE_CLIENT_QUOTAS,
        "ANONYMOUS",
    )
    assert conn.receive_from_client(frame(heartbeat(4)), 1) == []  # still waiting
    answer = describe_quotas_response(2, 1, [])
    # answered before the broker answered request 1: it waits for its turn
    resumed = conn.answer_quota_admin(answer, 2)
    assert out(resumed, ToClient) == []
    assert ids(out(resumed, ToBroker), True) == [3, 4]
    down = conn.receive_from_broker(frame(heartbeat_answer(1)), 3)
    assert ids(out(down, ToClient), False) == [1, 2]
    down = conn.receive_from_broker(frame(heartbeat_answer(3)) + frame(heartbeat_answer(4)), 4)
    assert ids(out(down, ToClient), False) == [3, 4]
    assert conn.closed is None
