"""The quota file: `[[quota]]` tables, validated the way Kafka validates client quotas."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from config.quotas import QuotaConfigError, load_quota_file, parse_quotas, validate_value
from quotas.entity import DEFAULT, QuotaEntity
from quotas.types import QuotaType

P, F, R, PIDS = QuotaType.PRODUCE, QuotaType.FETCH, QuotaType.REQUEST, QuotaType.PRODUCER_IDS

VALID = """
[[quota]]
user = "alice"
client_id = "etl"
producer_byte_rate = 1048576
consumer_byte_rate = 2097152
request_percentage = 50.0

[[quota]]
user = "<default>"
producer_ids_rate = 20

[[quota]]
user = "CN=svc,O=acme"
producer_ids_rate = 0.5
consumer_byte_rate = 1024.0

[[quota]]
client_id = "<default>"
producer_byte_rate = 8000
consumer_byte_rate = 2500

[[quota]]
user = "<default>"
client_id = "<default>"
request_percentage = 0.1

[[quota]]
user = "bob"
client_id = "<default>"
producer_byte_rate = 1
"""


def test_valid_file_parses(tmp_path: Path) -> None:
    path = tmp_path / "quotas.toml"
    path.write_text(VALID)
    assert load_quota_file(path) == {
        QuotaEntity("alice", "etl"): {P: 1048576.0, F: 2097152.0, R: 50.0},
        QuotaEntity(DEFAULT, None): {PIDS: 20.0},
        QuotaEntity("CN=svc,O=acme", None): {PIDS: 0.5, F: 1024.0},
        QuotaEntity(None, DEFAULT): {P: 8000.0, F: 2500.0},
        QuotaEntity(DEFAULT, DEFAULT): {R: 0.1},
        QuotaEntity("bob", DEFAULT): {P: 1.0},
    }


def test_empty_file_means_no_quotas(tmp_path: Path) -> None:
    path = tmp_path / "empty.toml"
    path.write_text("# nothing yet\n")
    assert load_quota_file(path) == {}


def test_entity_without_values_is_kept_empty() -> None:
    assert parse_quotas({"quota": [{"user": "alice"}]}) == {QuotaEntity("alice", None): {}}


def test_validate_value_returns_the_type_and_a_float() -> None:
    assert validate_value(QuotaEntity("u", None), "producer_byte_rate", 1024) == (P, 1024.0)
    assert validate_value(QuotaEntity(None, "c"), "request_percentage", 0.25) == (R, 0.25)
    assert validate_value(QuotaEntity(DEFAULT, None), "producer_ids_rate", 3) == (PIDS, 3.0)


# -- rejected values: the message names the entity, the key and the value ---------------------------


def reject(text: str) -> str:
    with pytest.raises(QuotaConfigError) as caught:
        parse_quotas(tomllib.loads(text))
    return str(caught.value)


@pytest.mark.parametrize(("entity", "key", "value", "shown"), [
    ('user = "alice"', "producer_byte_rte", "1024", "1024"),  # unknown key (a typo)
    ('user = "alice"', "producer_byte_rate", "0", "0"),
    ('user = "alice"', "consumer_byte_rate", "-5", "-5"),
    ('client_id = "etl"', "request_percentage", "-0.5", "-0.5"),
    ('client_id = "etl"', "request_percentage", "0.0", "0.0"),
    ('user = "alice"', "producer_byte_rate", "1024.5", "1024.5"),  # fractional byte rate
    ('user = "alice"', "consumer_byte_rate", "0.25", "0.25"),
    ('user = "alice"', "producer_byte_rate", "true", "True"),  # bool is not a number
    ('user = "alice"', "request_percentage", "false", "False"),
    ('user = "alice"', "producer_byte_rate", '"1024"', "'1024'"),  # strings are not numbers
    ('user = "alice"', "request_percentage", "nan", "nan"),
    ('user = "alice"', "producer_byte_rate", "inf", "inf"),
    ('client_id = "etl"', "producer_ids_rate", "5", "5"),  # user entities only
    ('user = "alice"\nclient_id = "etl"', "producer_ids_rate", "5", "5"),
])
def test_invalid_value_names_entity_key_and_value(entity: str, key: str, value: str, shown: str) -> None:
    message = reject(f"[[quota]]\n{entity}\n{key} = {value}\n")
    names = dict(line.split(" = ") for line in entity.splitlines())
    if "user" in names:
        assert f"user={names['user'].strip(chr(34))}" in message
    if "client_id" in names:
        assert f"client-id={names['client_id'].strip(chr(34))}" in message
    assert key in message
    assert re.search(re.escape(key) + r"\s*[=:]\s*" + re.escape(shown), message), \
        f"the value {shown} is not named in: {message}"


@pytest.mark.parametrize("entity", [
    'client_id = "etl"', 'client_id = "<default>"', 'user = "alice"\nclient_id = "etl"',
    'user = "alice"\nclient_id = "<default>"', 'user = "<default>"\nclient_id = "<default>"',
    'user = "<default>"\nclient_id = "etl"',
])
def test_producer_ids_rate_only_on_user_entities(entity: str) -> None:
    """KIP-936 draft: per user principal; any entity with a client-id part is refused."""
    message = reject(f"[[quota]]\n{entity}\nproducer_ids_rate = 5\n")
    assert "producer_ids_rate" in message and "user" in message


@pytest.mark.parametrize("entity", [
    'user = "alice"', 'client_id = "etl"', 'user = "alice"\nclient_id = "etl"', 'user = "<default>"',
    'client_id = "<default>"', 'user = "<default>"\nclient_id = "<default>"',
])
def test_controller_mutation_rate_is_accepted_for_users_and_client_ids(entity: str) -> None:
    """KIP-599: a double > 0 (partitions/s), on any user / client-id entity, defaults included."""
    table = parse_quotas(tomllib.loads(f"[[quota]]\n{entity}\ncontroller_mutation_rate = 2.5\n"))
    assert list(table.values()) == [{QuotaType.CONTROLLER_MUTATION: 2.5}]


@pytest.mark.parametrize("value", ["0", "-1", '"10"', "true"])
def test_controller_mutation_rate_must_be_a_positive_number(value: str) -> None:
    message = reject(f'[[quota]]\nuser = "alice"\ncontroller_mutation_rate = {value}\n')
    assert "controller_mutation_rate" in message and "user=alice" in message


def test_one_bad_entry_rejects_the_whole_file() -> None:
    message = reject(VALID + '\n[[quota]]\nuser = "carol"\nproducer_byte_rate = -1\n')
    assert "user=carol" in message


# -- rejected entities -------------------------------------------------------------------------------


def test_duplicate_entity_is_rejected() -> None:
    message = reject('[[quota]]\nuser = "alice"\nclient_id = "etl"\nproducer_byte_rate = 1\n'
                     '[[quota]]\nclient_id = "etl"\nuser = "alice"\nconsumer_byte_rate = 2\n')
    assert "user=alice" in message and "client-id=etl" in message
    assert "twice" in message


def test_duplicate_default_entity_is_rejected() -> None:
    message = reject('[[quota]]\nuser = "<default>"\nproducer_byte_rate = 1\n'
                     '[[quota]]\nuser = "<default>"\nproducer_byte_rate = 2\n')
    assert "user=<default>" in message


def test_same_user_with_and_without_client_is_two_entities() -> None:
    table = parse_quotas(tomllib.loads('[[quota]]\nuser = "alice"\nproducer_byte_rate = 1\n'
                                       '[[quota]]\nuser = "alice"\nclient_id = "<default>"\n'
                                       'producer_byte_rate = 2\n'))
    assert set(table) == {QuotaEntity("alice", None), QuotaEntity("alice", DEFAULT)}


def test_entity_with_neither_user_nor_client_id() -> None:
    message = reject('[[quota]]\nuser = "alice"\nproducer_byte_rate = 1\n'
                     '[[quota]]\nproducer_byte_rate = 1024\n')
    assert "#2" in message
    assert "neither" in message


@pytest.mark.parametrize(("line", "shown"), [
    ('user = ""', "user"), ('client_id = ""', "client_id"), ("user = 5", "5"), ("client_id = true", "True"),
])
def test_entity_names_must_be_non_empty_strings(line: str, shown: str) -> None:
    message = reject(f"[[quota]]\n{line}\nproducer_byte_rate = 1\n")
    assert shown in message and "#1" in message


@pytest.mark.parametrize("data", [{"quota": 5}, {"quota": {"user": "alice"}}, {"quota": "x"}])
def test_quota_must_be_an_array_of_tables(data: dict[str, Any]) -> None:
    with pytest.raises(QuotaConfigError, match=r"\[\[quota\]\]"):
        parse_quotas(data)


def test_quota_entry_must_be_a_table() -> None:
    with pytest.raises(QuotaConfigError, match="#2 is not a table"):
        parse_quotas({"quota": [{"user": "a", "producer_byte_rate": 1}, 7]})


# -- the file ------------------------------------------------------------------------------------


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    with pytest.raises(QuotaConfigError, match=r"nope\.toml"):
        load_quota_file(path)


def test_broken_toml_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text("[[quota]\nuser = \n")
    with pytest.raises(QuotaConfigError, match=r"broken\.toml"):
        load_quota_file(path)


def test_max_throttle_time_ms_is_a_positive_integer_or_absent(tmp_path: Path) -> None:
    """[proxy] max_throttle_time_ms: none by default (Kafka has no cap); bad values named."""
    from config.settings import SettingsError, load_settings

    path = tmp_path / "kthrottle.toml"
    path.write_text("[proxy]\n")
    assert load_settings(path).max_throttle_time_ms is None
    path.write_text("[proxy]\nmax_throttle_time_ms = 500\n")
    assert load_settings(path).max_throttle_time_ms == 500
    for bad in ("0", "-100", '"1s"', "true", "2.5"):
        path.write_text(f"[proxy]\nmax_throttle_time_ms = {bad}\n")
        with pytest.raises(SettingsError, match=re.escape("proxy.max_throttle_time_ms = ")
                           + ".*must be a positive integer"):
            load_settings(path)
