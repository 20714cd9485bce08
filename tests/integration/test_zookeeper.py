"""The ZooKeeper quota source against a real ZooKeeper 3.9 server started by the project's harness.

Nodes are written with plain kazoo exactly as Kafka 3.x laid them out (sanitized user and client-id names,
``<default>``, ``{"version":1,"config":{...}}`` with string values, change notifications), and
``config.zookeeper`` must read them, follow every change within a second, survive bad data and ZooKeeper
restarts, and write what Kafka's ``ZkAdminManager`` wrote. Each test works under its own chroot, so tests
sharing the module's server cannot see each other's nodes.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator

import pytest
from kazoo.client import KazooClient

from config.config_form import entity_for_path, entity_path, format_value, java_double
from config.quotas import QuotaConfigError
from config.zookeeper import ZooKeeperQuotaError, ZooKeeperQuotas
from harness.local_zookeeper import ZOOKEEPER_VERSION, LocalZooKeeper, four_letter_word
from harness.ports import free_port_block
from quotas.engine import QuotaTable
from quotas.entity import DEFAULT, QuotaEntity
from quotas.types import QuotaType

from .zookeeper import Recorder, kafka_json, kazoo_client, running_zookeeper, wait_until, write_entity

P, F, R, PIDS = QuotaType.PRODUCE, QuotaType.FETCH, QuotaType.REQUEST, QuotaType.PRODUCER_IDS

ALICE = "CN=alice,O=x"  # a TLS principal: '=' and ',' are sanitized in paths
ALICE_Z = "CN%3Dalice%2CO%3Dx"
UMLAUT = "üser"  # UTF-8 bytes are percent-encoded one by one
UMLAUT_Z = "%C3%BCser"
APP = "app 1/x"  # Kafka sanitizes client-ids in paths too
APP_Z = "app%201%2Fx"
SCRAM = "salt=c2FsdA==,stored_key=c3RvcmVk,server_key=c2VydmVy,iterations=4096"

#: A change must reach on_change within this long after the write returned (the issue's promise).
LIVE_WITHIN_S = 1.0
#: Bound on waits for things that are not timed promises (reconnection after a restart, log lines).
PATIENCE_S = 20.0


@pytest.fixture(scope="module")
def zookeeper() -> Iterator[LocalZooKeeper]:
    with running_zookeeper() as server:
        yield server


@pytest.fixture(scope="module")
def writer(zookeeper: LocalZooKeeper) -> Iterator[KazooClient]:
    with kazoo_client(zookeeper.connect_string) as kz:
        yield kz


@pytest.fixture
def chroot() -> str:
    return f"/kthrottle-test-{uuid.uuid4().hex[:12]}"


SourceFactory = Callable[..., tuple[ZooKeeperQuotas, Recorder]]


@pytest.fixture
def sources() -> Iterator[SourceFactory]:
    """Start ZooKeeperQuotas instances (hosts, chroot) with a Recorder each; all stopped at teardown."""
    started: list[ZooKeeperQuotas] = []

    def start(hosts: str, chroot: str, timeout: float = 10.0) -> tuple[ZooKeeperQuotas, Recorder]:
        recorder = Recorder()
        source = ZooKeeperQuotas(hosts, chroot, on_change=recorder, timeout=timeout)
        source.start()
        started.append(source)
        return source, recorder

    yield start
    for source in started:
        source.stop()


def has(entity: QuotaEntity, values: dict[QuotaType, float]) -> Callable[[QuotaTable], bool]:
    return lambda table: table.get(entity) == values


def lacks(entity: QuotaEntity) -> Callable[[QuotaTable], bool]:
    return lambda table: entity not in table


def node_config(kz: KazooClient, path: str) -> dict[str, str]:
    document = json.loads(kz.get(path)[0])
    assert document["version"] == 1, document
    config: dict[str, str] = document["config"]
    return config


def notifications(kz: KazooClient, chroot: str) -> list[dict[str, object]]:
    changes = f"{chroot}/config/changes"
    if kz.exists(changes) is None:
        return []
    return [json.loads(kz.get(f"{changes}/{name}")[0]) for name in sorted(kz.get_children(changes))]


# --------------------------------------------------------------------------------------------- harness


def test_harness_runs_the_pinned_zookeeper_version(zookeeper: LocalZooKeeper) -> None:
    answer = four_letter_word("127.0.0.1", zookeeper.port or 0, "srvr")
    assert f"Zookeeper version: {ZOOKEEPER_VERSION}-" in answer
    assert "Mode: standalone" in answer
    assert zookeeper.connect_string == f"127.0.0.1:{zookeeper.port}"


# --------------------------------------------------------------------------------------------- layout


@pytest.mark.parametrize(
    ("value", "java"),
    [(50.0, "50.0"), (0.5, "0.5"), (12.5, "12.5"), (1e7, "1.0E7"), (12345678.0, "1.2345678E7"),
     (9999999.0, "9999999.0"), (0.001, "0.001"), (0.0001, "1.0E-4"), (2 / 3, "0.6666666666666666")],
)  # fmt: skip
def test_doubles_are_written_as_java_prints_them(value: float, java: str) -> None:
    """Values checked against `Double.toString` of JDK 17; Kafka's ZkAdminManager wrote `value.toString`."""
    assert java_double(value) == java


def test_byte_rates_are_written_as_longs_and_other_quotas_as_doubles() -> None:
    assert format_value(P, 1024.0) == "1024"
    assert format_value(F, 1048576) == "1048576"
    assert format_value(R, 50) == "50.0"
    assert format_value(PIDS, 20) == "20.0"


def test_entity_paths_are_sanitized_like_kafka() -> None:
    assert entity_path(QuotaEntity(ALICE, APP)) == f"users/{ALICE_Z}/clients/{APP_Z}"
    assert entity_path(QuotaEntity(UMLAUT, None)) == f"users/{UMLAUT_Z}"
    assert entity_path(QuotaEntity(DEFAULT, DEFAULT)) == "users/<default>/clients/<default>"
    assert entity_path(QuotaEntity(None, DEFAULT)) == "clients/<default>"
    assert entity_for_path(f"users/{ALICE_Z}/clients/{APP_Z}") == QuotaEntity(ALICE, APP)
    assert entity_for_path("users/<default>") == QuotaEntity(DEFAULT, None)
    assert entity_path(QuotaEntity("<default>x", None)) == "users/%3Cdefault%3Ex"


# --------------------------------------------------------------------------------------------- reading


def test_initial_load_reads_all_eight_entity_kinds(
    zookeeper: LocalZooKeeper, writer: KazooClient, chroot: str, sources: SourceFactory
) -> None:
    write_entity(writer, chroot, f"users/{ALICE_Z}/clients/{APP_Z}", {"producer_byte_rate": "1024"})
    write_entity(writer, chroot, f"users/{ALICE_Z}/clients/<default>", {"consumer_byte_rate": "2048"})
    write_entity(writer, chroot, f"users/{ALICE_Z}",
                 {"request_percentage": "50.0", "producer_ids_rate": "20",
                  "SCRAM-SHA-256": SCRAM})  # fmt: skip
    write_entity(writer, chroot, "users/<default>/clients/etl", {"producer_byte_rate": "4096"})
    write_entity(writer, chroot, "users/<default>/clients/<default>", {"producer_byte_rate": "8192"})
    write_entity(writer, chroot, "users/<default>", {"consumer_byte_rate": "16384"})
    write_entity(writer, chroot, "clients/reporting", {"request_percentage": "25.5"})
    write_entity(writer, chroot, "clients/<default>", {"producer_byte_rate": "1048576"})
    write_entity(writer, chroot, f"users/{UMLAUT_Z}", {"producer_byte_rate": "100"})
    # users/bob is only the empty parent Kafka's createRecursive leaves: no entity of its own.
    write_entity(writer, chroot, "users/bob/clients/cli", {"consumer_byte_rate": "300"})
    assert writer.get(f"{chroot}/config/users/bob")[0] == b""

    source, recorder = sources(zookeeper.connect_string, chroot)

    expected: QuotaTable = {
        QuotaEntity(ALICE, APP): {P: 1024.0},
        QuotaEntity(ALICE, DEFAULT): {F: 2048.0},
        QuotaEntity(ALICE, None): {R: 50.0, PIDS: 20.0},
        QuotaEntity(DEFAULT, "etl"): {P: 4096.0},
        QuotaEntity(DEFAULT, DEFAULT): {P: 8192.0},
        QuotaEntity(DEFAULT, None): {F: 16384.0},
        QuotaEntity(None, "reporting"): {R: 25.5},
        QuotaEntity(None, DEFAULT): {P: 1048576.0},
        QuotaEntity(UMLAUT, None): {P: 100.0},
        QuotaEntity("bob", "cli"): {F: 300.0},
    }
    assert recorder.count() == 1, "start() delivers the initial table exactly once"
    assert recorder.latest == expected
    assert source.current() == expected
    assert source.connected


def test_changes_reach_on_change_within_a_second(
    zookeeper: LocalZooKeeper, writer: KazooClient, chroot: str, sources: SourceFactory
) -> None:
    _source, recorder = sources(zookeeper.connect_string, chroot)
    assert recorder.latest == {}, "an empty ZooKeeper (not even /config) is an empty table"
    carol = QuotaEntity("carol", "svc")
    steps = [
        ("created with its parents", {"producer_byte_rate": "1000"}, {P: 1000.0}),
        (
            "data changed",
            {"producer_byte_rate": "2000", "consumer_byte_rate": "3000"},
            {P: 2000.0, F: 3000.0},
        ),
        ("key removed", {"consumer_byte_rate": "3000"}, {F: 3000.0}),
    ]
    for what, config, values in steps:
        written = time.monotonic()
        write_entity(writer, chroot, "users/carol/clients/svc", config)
        arrived = recorder.wait_for(has(carol, values), PATIENCE_S, what)
        assert arrived - written < LIVE_WITHIN_S, f"{what}: took {arrived - written:.3f} s"
    # A new sibling under an existing parent (child watch on users/<u>/clients).
    written = time.monotonic()
    write_entity(writer, chroot, "users/carol/clients/batch", {"request_percentage": "10.0"})
    arrived = recorder.wait_for(has(QuotaEntity("carol", "batch"), {R: 10.0}), PATIENCE_S, "a sibling")
    assert arrived - written < LIVE_WITHIN_S
    assert recorder.latest[carol] == {F: 3000.0}


def test_deleted_nodes_leave_the_table(
    zookeeper: LocalZooKeeper, writer: KazooClient, chroot: str, sources: SourceFactory
) -> None:
    write_entity(writer, chroot, "users/dave/clients/a", {"producer_byte_rate": "10"})
    write_entity(writer, chroot, "users/dave", {"producer_byte_rate": "20"})
    write_entity(writer, chroot, "clients/a", {"producer_byte_rate": "30"})
    _source, recorder = sources(zookeeper.connect_string, chroot)
    assert len(recorder.latest) == 3

    written = time.monotonic()
    writer.delete(f"{chroot}/config/users/dave/clients/a")
    arrived = recorder.wait_for(lacks(QuotaEntity("dave", "a")), PATIENCE_S, "the user/client entity to go")
    assert arrived - written < LIVE_WITHIN_S
    assert recorder.latest == {QuotaEntity("dave", None): {P: 20.0}, QuotaEntity(None, "a"): {P: 30.0}}

    writer.delete(f"{chroot}/config/users", recursive=True)
    recorder.wait_for(lambda t: t == {QuotaEntity(None, "a"): {P: 30.0}}, PATIENCE_S, "all users to go")
    # The users node is gone: an existence watch must notice it coming back.
    write_entity(writer, chroot, "users/erin", {"consumer_byte_rate": "40"})
    recorder.wait_for(
        has(QuotaEntity("erin", None), {F: 40.0}), PATIENCE_S, "users/erin after /users was deleted"
    )


INVALID = [
    pytest.param("users/frank", {"producer_byte_rate": "abc"}, QuotaEntity("frank", None),
                 ["user=frank", "producer_byte_rate", "'abc'"], id="non-numeric"),
    pytest.param("users/frank", {"producer_byte_rate": "0"}, QuotaEntity("frank", None),
                 ["user=frank", "producer_byte_rate", "0"], id="zero"),
    pytest.param("users/frank", {"request_percentage": "-5.0"}, QuotaEntity("frank", None),
                 ["user=frank", "request_percentage", "-5.0"], id="negative"),
    pytest.param("users/frank", {"consumer_byte_rate": "1024.5"}, QuotaEntity("frank", None),
                 ["user=frank", "consumer_byte_rate", "1024.5", "whole number"], id="fractional-byte-rate"),
    pytest.param("clients/app", {"producer_ids_rate": "5"}, QuotaEntity(None, "app"),
                 ["client-id=app", "producer_ids_rate", "5", "user entities only"], id="pid-rate-on-client"),
    pytest.param("users/frank/clients/app", {"producer_ids_rate": "5"}, QuotaEntity("frank", "app"),
                 ["user=frank, client-id=app", "producer_ids_rate", "user entities only"],
                 id="pid-rate-on-pair"),
    pytest.param("users/frank", b'{"version":1,"config":{"producer_byte_rate":', QuotaEntity("frank", None),
                 ["user=frank", "not Kafka's config JSON"], id="truncated-json"),
    pytest.param("users/frank", b'{"version":1,"config":["producer_byte_rate"]}', QuotaEntity("frank", None),
                 ["user=frank", "\"config\" is list"], id="config-not-an-object"),
    pytest.param("users/frank", b'{"version":1,"config":{"producer_byte_rate":1024}}',
                 QuotaEntity("frank", None),
                 ["user=frank", "producer_byte_rate", "1024", "string"], id="number-not-string"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "bad", "entity", "named"), INVALID)
def test_invalid_data_keeps_the_last_good_values_and_logs_why(
    zookeeper: LocalZooKeeper,
    writer: KazooClient,
    chroot: str,
    sources: SourceFactory,
    caplog: pytest.LogCaptureFixture,
    path: str,
    bad: dict[str, str] | bytes,
    entity: QuotaEntity,
    named: list[str],
) -> None:
    good = {QuotaType.REQUEST: 40.0}
    write_entity(writer, chroot, path, {"request_percentage": "40.0"})
    write_entity(writer, chroot, "clients/bystander", {"producer_byte_rate": "7"})
    source, recorder = sources(zookeeper.connect_string, chroot)
    assert recorder.latest[entity] == good
    calls = recorder.count()

    write_entity(writer, chroot, path, bad)

    def logged() -> list[logging.LogRecord]:
        return [
            r for r in caplog.records if r.levelno == logging.ERROR and f"config/{path}:" in r.getMessage()
        ]

    wait_until(lambda: bool(logged()), PATIENCE_S, f"an error about {path}")
    message = logged()[0].getMessage()
    for part in named:
        assert part in message, f"{part!r} missing from {message!r}"
    assert "keeping its last good quotas {request_percentage=40}" in message
    assert source.current()[entity] == good
    assert recorder.count() == calls, "nothing changed, so on_change must not be called"

    # Other entities still follow ZooKeeper while this one is broken, and it is reported only once.
    write_entity(writer, chroot, "clients/bystander", {"producer_byte_rate": "8"})
    recorder.wait_for(has(QuotaEntity(None, "bystander"), {P: 8.0}), PATIENCE_S, "the bystander's change")
    assert recorder.latest[entity] == good
    assert len(logged()) == 1

    # Fixing the node applies the fixed values.
    write_entity(writer, chroot, path, {"request_percentage": "45.0"})
    recorder.wait_for(has(entity, {QuotaType.REQUEST: 45.0}), PATIENCE_S, "the fixed node")


def test_invalid_node_without_good_values_is_left_out(
    zookeeper: LocalZooKeeper,
    writer: KazooClient,
    chroot: str,
    sources: SourceFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    write_entity(writer, chroot, "users/gina", {"producer_byte_rate": "lots"})
    write_entity(writer, chroot, "users/hank", {"producer_byte_rate": "5"})
    _source, recorder = sources(zookeeper.connect_string, chroot)
    assert recorder.latest == {QuotaEntity("hank", None): {P: 5.0}}
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("user=gina" in m and "'lots'" in m and "no last good" in m for m in errors), errors


def test_scram_credentials_are_ignored_silently_and_controller_mutation_rate_enforced(
    zookeeper: LocalZooKeeper,
    writer: KazooClient,
    chroot: str,
    sources: SourceFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="kthrottle.config.zookeeper")
    write_entity(writer, chroot, "users/ivan", {
        "SCRAM-SHA-256": SCRAM, "SCRAM-SHA-512": SCRAM,
        "controller_mutation_rate": "10.0", "producer_byte_rate": "512",
    })  # fmt: skip
    write_entity(writer, chroot, "users/judy", {"SCRAM-SHA-512": SCRAM})  # credentials only: no quota entity
    _source, recorder = sources(zookeeper.connect_string, chroot)
    assert recorder.latest == {QuotaEntity("ivan", None): {P: 512.0, QuotaType.CONTROLLER_MUTATION: 10.0}}

    write_entity(writer, chroot, "clients/other", {"consumer_byte_rate": "1"})  # makes it read ivan again
    recorder.wait_for(has(QuotaEntity(None, "other"), {F: 1.0}), PATIENCE_S, "another change")
    mine = [r for r in caplog.records if r.name == "kthrottle.config.zookeeper"]
    assert not [r for r in mine if r.levelno >= logging.WARNING], [r.getMessage() for r in mine]
    assert not [r.getMessage() for r in mine if "controller_mutation_rate" in r.getMessage()]
    assert not [r for r in mine if "SCRAM" in r.getMessage()]


def test_two_instances_share_one_configuration(
    zookeeper: LocalZooKeeper, writer: KazooClient, chroot: str, sources: SourceFactory
) -> None:
    write_entity(writer, chroot, "users/<default>", {"producer_byte_rate": "100"})
    first, first_rec = sources(zookeeper.connect_string, chroot)
    second, second_rec = sources(zookeeper.connect_string, chroot)
    assert first_rec.latest == second_rec.latest == {QuotaEntity(DEFAULT, None): {P: 100.0}}

    write_entity(writer, chroot, "users/kim/clients/x", {"consumer_byte_rate": "200"})
    writer.delete(f"{chroot}/config/users/<default>")
    expected = {QuotaEntity("kim", "x"): {F: 200.0}}
    for recorder in (first_rec, second_rec):
        recorder.wait_for(lambda t: t == expected, PATIENCE_S, "both instances to follow")

    second.alter({QuotaEntity(None, DEFAULT): {R: 30.0}})
    expected = {**expected, QuotaEntity(None, DEFAULT): {R: 30.0}}
    first_rec.wait_for(lambda t: t == expected, PATIENCE_S, "the first instance to see the second's alter")
    second_rec.wait_for(lambda t: t == expected, PATIENCE_S, "the second instance to see its own alter")
    assert first.current() == second.current() == expected


# --------------------------------------------------------------------------------------------- writing


def test_alter_writes_what_kafka_wrote_and_a_second_instance_sees_it(
    zookeeper: LocalZooKeeper, writer: KazooClient, chroot: str, sources: SourceFactory
) -> None:
    base = f"{chroot}/config"
    write_entity(writer, chroot, f"users/{ALICE_Z}", {"SCRAM-SHA-256": SCRAM})  # credentials stay
    before = len(notifications(writer, chroot))
    admin, _admin_rec = sources(zookeeper.connect_string, chroot)
    other, other_rec = sources(zookeeper.connect_string, chroot)

    written = time.monotonic()
    admin.alter({
        QuotaEntity(ALICE, None): {P: 1024.0, R: 50.0},
        QuotaEntity(ALICE, APP): {F: 2048.0},
        QuotaEntity(DEFAULT, None): {PIDS: 20.0},
        QuotaEntity(None, DEFAULT): {R: 12.5},
    })  # fmt: skip
    expected = {
        QuotaEntity(ALICE, None): {P: 1024.0, R: 50.0},
        QuotaEntity(ALICE, APP): {F: 2048.0},
        QuotaEntity(DEFAULT, None): {PIDS: 20.0},
        QuotaEntity(None, DEFAULT): {R: 12.5},
    }
    arrived = other_rec.wait_for(lambda t: t == expected, PATIENCE_S, "the alter on the other instance")
    assert arrived - written < LIVE_WITHIN_S + 1.0  # the write itself is several round trips
    assert other.current() == expected

    assert node_config(writer, f"{base}/users/{ALICE_Z}") == {
        "SCRAM-SHA-256": SCRAM, "producer_byte_rate": "1024", "request_percentage": "50.0",
    }  # fmt: skip
    assert node_config(writer, f"{base}/users/{ALICE_Z}/clients/{APP_Z}") == {"consumer_byte_rate": "2048"}
    assert node_config(writer, f"{base}/users/<default>") == {"producer_ids_rate": "20.0"}
    assert node_config(writer, f"{base}/clients/<default>") == {"request_percentage": "12.5"}
    raw = writer.get(f"{base}/clients/<default>")[0]
    assert raw == b'{"version":1,"config":{"request_percentage":"12.5"}}', "Jackson's compact JSON"
    new = notifications(writer, chroot)[before:]
    assert new == [
        {"version": 2, "entity_path": f"users/{ALICE_Z}"},
        {"version": 2, "entity_path": f"users/{ALICE_Z}/clients/{APP_Z}"},
        {"version": 2, "entity_path": "users/<default>"},
        {"version": 2, "entity_path": "clients/<default>"},
    ]
    assert all(name.startswith("config_change_") for name in writer.get_children(f"{base}/changes"))

    # Removing every quota of a node that still holds credentials keeps it, credentials only.
    admin.alter({QuotaEntity(ALICE, None): {P: None, R: None}})
    other_rec.wait_for(lacks(QuotaEntity(ALICE, None)), PATIENCE_S, "alice's user quotas to go")
    assert node_config(writer, f"{base}/users/{ALICE_Z}") == {"SCRAM-SHA-256": SCRAM}

    # An emptied leaf is deleted with its `clients` parent (Kafka 3.5+), the user node stays for its SCRAM.
    admin.alter({QuotaEntity(ALICE, APP): {F: None}})
    other_rec.wait_for(lacks(QuotaEntity(ALICE, APP)), PATIENCE_S, "alice/app to go")
    assert writer.exists(f"{base}/users/{ALICE_Z}/clients") is None
    assert writer.exists(f"{base}/users/{ALICE_Z}") is not None

    # Without credentials the emptied user node goes too; a user node with children is emptied, not deleted.
    admin.alter({QuotaEntity("leo", "x"): {P: 5.0}})
    other_rec.wait_for(has(QuotaEntity("leo", "x"), {P: 5.0}), PATIENCE_S, "leo/x")
    admin.alter({QuotaEntity("leo", "x"): {P: None}})
    other_rec.wait_for(lacks(QuotaEntity("leo", "x")), PATIENCE_S, "leo/x to go")
    assert writer.exists(f"{base}/users/leo") is None
    admin.alter({QuotaEntity("mia", None): {P: 1.0}, QuotaEntity("mia", "y"): {P: 2.0}})
    admin.alter({QuotaEntity("mia", None): {P: None}})
    other_rec.wait_for(lambda t: QuotaEntity("mia", None) not in t and QuotaEntity("mia", "y") in t,
                       PATIENCE_S, "mia's user quota to go")  # fmt: skip
    assert writer.get(f"{base}/users/mia")[0] == kafka_json({})

    assert notifications(writer, chroot)[-1] == {"version": 2, "entity_path": "users/mia"}
    admin.alter({QuotaEntity(None, DEFAULT): {R: None}})
    other_rec.wait_for(lacks(QuotaEntity(None, DEFAULT)), PATIENCE_S, "the client default to go")
    assert writer.exists(f"{base}/clients/<default>") is None


def test_ip_entities_in_kafkas_layout_read_and_written(
    zookeeper: LocalZooKeeper, writer: KazooClient, chroot: str, sources: SourceFactory
) -> None:
    """KIP-612's /config/ips/<ip> and /config/ips/<default>, as Kafka's tools write them, plus a CIDR
    prefix (kthrottle's, its "/" written %2F); an invalid ip node keeps nothing and names itself."""
    conn = QuotaType.CONNECTION_CREATION
    write_entity(writer, chroot, "ips/10.1.2.3", {"connection_creation_rate": "20"})
    write_entity(writer, chroot, "ips/<default>", {"connection_creation_rate": "5"})
    write_entity(writer, chroot, "ips/not-an-ip", {"connection_creation_rate": "5"})
    admin, admin_rec = sources(zookeeper.connect_string, chroot)
    expected = {QuotaEntity(None, None, "10.1.2.3"): {conn: 20.0},
                QuotaEntity(None, None, DEFAULT): {conn: 5.0}}
    assert admin_rec.latest == expected
    _other, other_rec = sources(zookeeper.connect_string, chroot)
    admin.alter({QuotaEntity(None, None, "10.2.0.0/16"): {conn: 50.0},
                 QuotaEntity(None, None, "10.1.2.3"): {conn: None}})
    other_rec.wait_for(lambda t: t == {QuotaEntity(None, None, "10.2.0.0/16"): {conn: 50.0},
                                       QuotaEntity(None, None, DEFAULT): {conn: 5.0}},
                       PATIENCE_S, "the ip alter on the other instance")
    base = f"{chroot}/config"
    assert node_config(writer, f"{base}/ips/10.2.0.0%2F16") == {"connection_creation_rate": "50"}
    assert writer.exists(f"{base}/ips/10.1.2.3") is None


def test_invalid_alter_writes_nothing(
    zookeeper: LocalZooKeeper, writer: KazooClient, chroot: str, sources: SourceFactory
) -> None:
    admin, recorder = sources(zookeeper.connect_string, chroot)
    admin.alter({QuotaEntity("nina", None): {P: 1.0}})
    recorder.wait_for(has(QuotaEntity("nina", None), {P: 1.0}), PATIENCE_S, "nina")
    count = len(notifications(writer, chroot))
    bad_changes = [
        {QuotaEntity("nina", None): {P: 2.0}, QuotaEntity(None, "c"): {PIDS: 5.0}},  # user entities only
        {QuotaEntity("nina", None): {F: 10.5}},  # fractional byte rate
        {QuotaEntity("nina", None): {R: 0.0}},
        {QuotaEntity("", None): {R: 1.0}},
    ]
    for changes in bad_changes:
        with pytest.raises(QuotaConfigError):
            admin.alter(changes)
    assert len(notifications(writer, chroot)) == count
    assert node_config(writer, f"{chroot}/config/users/nina") == {"producer_byte_rate": "1"}
    assert admin.current() == {QuotaEntity("nina", None): {P: 1.0}}


def test_chroots_are_isolated_and_created_when_writing(
    zookeeper: LocalZooKeeper, writer: KazooClient, chroot: str, sources: SourceFactory
) -> None:
    tenant_a, tenant_b = f"{chroot}/a", f"{chroot}-b/kafka/"  # a trailing slash is tolerated
    a, a_rec = sources(zookeeper.connect_string, tenant_a)
    b, b_rec = sources(zookeeper.connect_string, tenant_b)
    parent, parent_rec = sources(zookeeper.connect_string, chroot)
    assert writer.exists(tenant_a) is None, "reading must not create the chroot"

    a.alter({QuotaEntity("olga", None): {P: 10.0}})
    assert writer.exists(f"{tenant_a}/config/users/olga") is not None
    a_rec.wait_for(has(QuotaEntity("olga", None), {P: 10.0}), PATIENCE_S, "olga in tenant a")

    write_entity(writer, chroot + "-b/kafka", "users/olga", {"producer_byte_rate": "20"})
    b_rec.wait_for(has(QuotaEntity("olga", None), {P: 20.0}), PATIENCE_S, "olga in tenant b")
    write_entity(writer, chroot, "users/olga", {"producer_byte_rate": "30"})
    parent_rec.wait_for(has(QuotaEntity("olga", None), {P: 30.0}), PATIENCE_S, "olga at the parent chroot")

    assert a.current() == {QuotaEntity("olga", None): {P: 10.0}}
    assert b.current() == {QuotaEntity("olga", None): {P: 20.0}}
    assert parent.current() == {QuotaEntity("olga", None): {P: 30.0}}
    assert notifications(writer, tenant_a) == [{"version": 2, "entity_path": "users/olga"}]
    assert b.chroot == f"{chroot}-b/kafka"


# --------------------------------------------------------------------------------------------- outages


def test_zookeeper_restart_keeps_the_quotas_and_resynchronises(
    sources: SourceFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kthrottle.config.zookeeper")
    chroot = "/kafka"
    with running_zookeeper() as server:
        address = server.connect_string
        with kazoo_client(address) as kz:
            write_entity(kz, chroot, "users/pia", {"producer_byte_rate": "1000"})
        source, recorder = sources(address, chroot, timeout=5.0)
        before = {QuotaEntity("pia", None): {P: 1000.0}}
        assert recorder.latest == before

        server.stop()
        wait_until(lambda: not source.connected, PATIENCE_S, "the source to notice ZooKeeper is gone")
        calls = recorder.count()
        with pytest.raises(ZooKeeperQuotaError, match=address):
            source.alter({QuotaEntity("pia", None): {P: 2000.0}})
        time.sleep(2.0)  # long enough for several reconnection attempts
        assert recorder.count() == calls, "losing ZooKeeper must not change the table"
        assert source.current() == before

        server.start()
        assert server.connect_string == address, "same port after a restart"
        wait_until(lambda: source.connected, PATIENCE_S, "the source to reconnect")
        with kazoo_client(address) as kz:
            assert node_config(kz, f"{chroot}/config/users/pia") == {"producer_byte_rate": "1000"}, (
                "data kept"
            )
            written = time.monotonic()
            write_entity(kz, chroot, "users/quinn", {"consumer_byte_rate": "500"})
            arrived = recorder.wait_for(
                has(QuotaEntity("quinn", None), {F: 500.0}), PATIENCE_S, "after restart"
            )
            assert arrived - written < LIVE_WITHIN_S, "watches are re-armed after reconnecting"
        source.alter({QuotaEntity("pia", None): {P: 3000.0}})
        recorder.wait_for(
            has(QuotaEntity("pia", None), {P: 3000.0}), PATIENCE_S, "an alter after the restart"
        )
        assert recorder.latest == {
            QuotaEntity("pia", None): {P: 3000.0},
            QuotaEntity("quinn", None): {F: 500.0},
        }
        assert not [c for _, c in recorder.calls if not c], "never an empty table"
    messages = [r.getMessage() for r in caplog.records if r.name == "kthrottle.config.zookeeper"]
    assert any("connection lost" in m for m in messages), messages
    assert any("connected; resynchronising" in m for m in messages), messages


def test_changes_made_while_zookeeper_was_unreachable_by_this_proxy_are_picked_up(
    sources: SourceFactory,
) -> None:
    """The source's connection drops while another writer keeps changing quotas: the resync finds them."""
    with running_zookeeper() as server:
        address = server.connect_string
        with kazoo_client(address) as kz:
            write_entity(kz, "", "users/rita", {"producer_byte_rate": "1"})
            write_entity(kz, "", "users/sam", {"producer_byte_rate": "2"})
        source, recorder = sources(address, "", timeout=5.0)
        assert len(recorder.latest) == 2
        server.stop()
        wait_until(lambda: not source.connected, PATIENCE_S, "the source to notice ZooKeeper is gone")
        server.start()
        # Write as soon as the server is back: this races with the source's reconnection, on purpose.
        with kazoo_client(address) as kz:
            write_entity(kz, "", "users/rita", {"producer_byte_rate": "10"})
            kz.delete("/config/users/sam")
        expected = {QuotaEntity("rita", None): {P: 10.0}}
        recorder.wait_for(lambda t: t == expected, PATIENCE_S, "the changes made around the restart")


def test_session_expiry_resynchronises_and_rearms_watches(
    zookeeper: LocalZooKeeper, writer: KazooClient, chroot: str, sources: SourceFactory,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    write_entity(writer, chroot, "users/tom", {"producer_byte_rate": "1"})
    source, recorder = sources(zookeeper.connect_string, chroot, timeout=5.0)
    client = source._client  # the test needs the session's id and password to expire it
    assert client is not None
    session_id, password = client.client_id
    # Closing a second connection that resumes the same session makes the server expire it.
    intruder = KazooClient(hosts=zookeeper.connect_string, client_id=(session_id, password))
    intruder.start(timeout=10)
    intruder.stop()
    intruder.close()
    write_entity(writer, chroot, "users/tom", {"producer_byte_rate": "2"})  # while the session is gone
    wait_until(lambda: source.connected and client.client_id[0] != session_id, PATIENCE_S, "a new session")
    recorder.wait_for(has(QuotaEntity("tom", None), {P: 2.0}), PATIENCE_S, "the change made during expiry")
    written = time.monotonic()
    write_entity(writer, chroot, "users/tom", {"producer_byte_rate": "3"})
    arrived = recorder.wait_for(
        has(QuotaEntity("tom", None), {P: 3.0}), PATIENCE_S, "a change on the new session"
    )
    assert arrived - written < LIVE_WITHIN_S
    assert any("session lost" in r.getMessage() for r in caplog.records), "the expiry is logged"


def test_start_fails_clearly_when_zookeeper_is_unreachable() -> None:
    port = free_port_block(1)  # nothing listens there
    recorder = Recorder()
    source = ZooKeeperQuotas(f"127.0.0.1:{port}", on_change=recorder, timeout=1.0)
    began = time.monotonic()
    with pytest.raises(ZooKeeperQuotaError, match=f"127.0.0.1:{port}"):
        source.start()
    assert time.monotonic() - began < 5.0
    assert recorder.count() == 0
    assert not source.connected
