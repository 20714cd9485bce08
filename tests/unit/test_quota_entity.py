"""Who shares a quota: Kafka's eight entity levels, bucket keys, and user-name sanitizing."""

from __future__ import annotations

import re

import pytest

from quotas.entity import DEFAULT, BucketKey, QuotaEntity, candidate_entities, desanitize, resolve, sanitize
from quotas.manager import ClientQuotaManager
from quotas.types import QuotaType

# -- sanitize / desanitize ------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "sanitized"), [
    ("CN=a b,O=x", "CN%3Da%20b%2CO%3Dx"),
    ("alice", "alice"),
    ("A-Z_a.z-09", "A-Z_a.z-09"),
    ("user@example.com", "user%40example.com"),
    ("*", "%2A"),  # URLEncoder keeps '*'; Kafka then encodes it for JMX
    ("+", "%2B"),
    (" ", "%20"),  # URLEncoder's '+' for a space becomes %20 in Kafka
    ("~", "%7E"),
    ("%", "%25"),
    ("é", "%C3%A9"),  # UTF-8 bytes, uppercase hex
    ("日本", "%E6%97%A5%E6%9C%AC"),
    ("\U0001f600", "%F0%9F%98%80"),
    ("<default>", "%3Cdefault%3E"),
    ("", ""),
    # Kafka's SanitizerTest principal
    ("CN=Some characters !@#$%&*()_-+=';:,/~",
     "CN%3DSome%20characters%20%21%40%23%24%25%26%2A%28%29_-%2B%3D%27%3B%3A%2C%2F%7E"),
])
def test_sanitize_matches_kafka(name: str, sanitized: str) -> None:
    assert sanitize(name) == sanitized
    assert re.fullmatch(r"[A-Za-z0-9._\-%]*", sanitize(name))
    assert desanitize(sanitized) == name


@pytest.mark.parametrize("name", [
    "CN=Some characters !@#$%&*()_-+=';:,/~", "a%20b", "100%", "ünïcødé ☃ \U0001f600", "x+y", "%%%",
])
def test_desanitize_round_trips(name: str) -> None:
    assert desanitize(sanitize(name)) == name


def test_sanitize_uses_uppercase_hex() -> None:
    encoded = sanitize("\xff/\x1f:")
    assert encoded == "%C3%BF%2F%1F%3A"
    assert encoded != encoded.lower()


# -- the eight levels -------------------------------------------------------------------------

USER, CLIENT = "alice", "app"

#: (entity, bucket key it gives alice/app), most specific first, as in QUOTA_SEMANTICS.md §4
LEVELS = [
    (QuotaEntity(USER, CLIENT), BucketKey(USER, CLIENT)),
    (QuotaEntity(USER, DEFAULT), BucketKey(USER, CLIENT)),
    (QuotaEntity(USER, None), BucketKey(USER, "")),
    (QuotaEntity(DEFAULT, CLIENT), BucketKey(USER, CLIENT)),
    (QuotaEntity(DEFAULT, DEFAULT), BucketKey(USER, CLIENT)),
    (QuotaEntity(DEFAULT, None), BucketKey(USER, "")),
    (QuotaEntity(None, CLIENT), BucketKey("", CLIENT)),
    (QuotaEntity(None, DEFAULT), BucketKey("", CLIENT)),
]

#: entities that never govern alice/app
OTHERS = {
    QuotaEntity("bob", CLIENT): 901.0,
    QuotaEntity("bob", None): 902.0,
    QuotaEntity("bob", DEFAULT): 903.0,
    QuotaEntity(USER, "other"): 904.0,
    QuotaEntity(DEFAULT, "other"): 905.0,
    QuotaEntity(None, "other"): 906.0,
}


def test_candidate_entities_are_the_eight_levels_in_order() -> None:
    assert list(candidate_entities(USER, CLIENT)) == LEVELS


@pytest.mark.parametrize("level", range(8))
def test_each_level_shadows_the_ones_below(level: int) -> None:
    quotas = {entity: float(index + 1) for index, (entity, _) in enumerate(LEVELS) if index >= level}
    quotas.update(OTHERS)
    assert resolve(quotas, USER, CLIENT) == (LEVELS[level][1], float(level + 1))


@pytest.mark.parametrize("level", range(8))
def test_each_level_alone_applies_with_its_bucket_key(level: int) -> None:
    entity, key = LEVELS[level]
    assert resolve({entity: 42.0, **OTHERS}, USER, CLIENT) == (key, 42.0)


def test_no_match_is_unlimited() -> None:
    assert resolve({}, USER, CLIENT) is None
    assert resolve(OTHERS, USER, CLIENT) is None
    manager = ClientQuotaManager(QuotaType.PRODUCE)
    manager.set_quotas(OTHERS)
    charge = manager.record(USER, CLIENT, 10**12, 0)
    assert (charge.bucket, charge.throttle_ms) == (None, 0)
    assert manager.buckets == {}


def test_null_client_id_is_the_empty_string() -> None:
    assert resolve({QuotaEntity(None, DEFAULT): 5.0}, USER, "") == (BucketKey("", ""), 5.0)
    assert resolve({QuotaEntity(DEFAULT, DEFAULT): 5.0}, USER, "") == (BucketKey(USER, ""), 5.0)


def test_client_ids_are_matched_raw() -> None:
    """Kafka's testClientIdNotSanitized: client-ids are used as they come."""
    odd = "client@#$%"
    assert resolve({QuotaEntity(None, odd): 3.0}, USER, odd) == (BucketKey("", odd), 3.0)


# -- sharing, through the manager (Kafka's testQuotaConfigPrecedence) -------------------------


def check(manager: ClientQuotaManager, user: str, client: str, bound: float, value: int,
          throttled: bool) -> None:
    """Kafka's checkQuota: the bound that applies, then record value x 11 samples at t=0."""
    found = manager.resolve(user, client)
    assert found is not None and found[1] == bound
    throttle = manager.record(user, client, value * 11, 0).throttle_ms
    assert (throttle > 0) is throttled, f"{user}/{client}: throttle {throttle}"


def test_kafka_quota_config_precedence() -> None:
    manager = ClientQuotaManager(QuotaType.PRODUCE)
    manager.set_quotas({
        QuotaEntity(DEFAULT, None): 1000, QuotaEntity(None, DEFAULT): 2000,
        QuotaEntity(DEFAULT, DEFAULT): 3000, QuotaEntity("userA", None): 4000,
        QuotaEntity("userA", "client1"): 5000, QuotaEntity("userB", None): 6000,
        QuotaEntity("userB", "client1"): 7000, QuotaEntity("userB", DEFAULT): 8000,
        QuotaEntity("userC", None): 10000, QuotaEntity(None, "client1"): 9000,
    })
    check(manager, "userA", "client1", 5000, 4500, False)  # <user, client> over <user>
    check(manager, "userA", "client2", 4000, 4500, True)  # <user> over <client> and defaults
    check(manager, "userA", "client3", 4000, 0, True)  # <user> is shared across the user's clients
    check(manager, "userA", "client1", 5000, 0, False)  # <user, client> is its own
    check(manager, "userB", "client1", 7000, 8000, True)
    check(manager, "userB", "client2", 8000, 7000, False)  # <user, default client>: one each
    check(manager, "userB", "client3", 8000, 7000, False)
    check(manager, "userD", "client1", 3000, 3500, True)  # <default user, default client>
    check(manager, "userD", "client2", 3000, 2500, False)
    check(manager, "userE", "client1", 3000, 2500, False)


def test_client_level_bucket_is_shared_by_all_users() -> None:
    manager = ClientQuotaManager(QuotaType.PRODUCE)
    manager.set_quotas({QuotaEntity(None, "app"): 100})
    assert manager.record("alice", "app", 600, 0).throttle_ms == 0
    assert manager.record("bob", "app", 600, 0).throttle_ms > 0  # 1200 B over 10 s > 100 B/s
    assert set(manager.buckets) == {BucketKey("", "app")}


# -- quota changes and bucket history ------------------------------------------------------------


def test_changed_bound_keeps_the_bucket_history() -> None:
    manager = ClientQuotaManager(QuotaType.PRODUCE)
    manager.set_quotas({QuotaEntity(USER, None): 1000})
    assert manager.record(USER, CLIENT, 9000, 0).throttle_ms == 0
    manager.set_quotas({QuotaEntity(USER, None): 500})
    charge = manager.record(USER, CLIENT, 1, 0)
    assert charge.observed == pytest.approx(900.1)
    assert charge.throttle_ms == 8002  # (900.1 - 500) / 500 * 10000


def test_other_entity_with_the_same_key_keeps_the_history() -> None:
    """<user, client> replaced by <default user, default client>: both key (alice, app)."""
    manager = ClientQuotaManager(QuotaType.PRODUCE)
    manager.set_quotas({QuotaEntity(USER, CLIENT): 1000})
    manager.record(USER, CLIENT, 9000, 0)
    manager.set_quotas({QuotaEntity(DEFAULT, DEFAULT): 1000})
    charge = manager.record(USER, CLIENT, 2000, 0)
    assert charge.bucket == BucketKey(USER, CLIENT)
    assert charge.throttle_ms == 1000  # 11000 B / 10 s = 1100 B/s: (100/1000) * 10000


def test_key_change_starts_from_zero() -> None:
    """Removing the user quota that shadowed <default, default> moves alice to a new bucket."""
    manager = ClientQuotaManager(QuotaType.PRODUCE)
    manager.set_quotas({QuotaEntity(USER, None): 1000, QuotaEntity(DEFAULT, DEFAULT): 500})
    first = manager.record(USER, CLIENT, 9000, 0)
    assert (first.bucket, first.throttle_ms) == (BucketKey(USER, ""), 0)
    manager.set_quotas({QuotaEntity(DEFAULT, DEFAULT): 500})
    second = manager.record(USER, CLIENT, 5000, 0)
    assert second.bucket == BucketKey(USER, CLIENT)
    assert second.observed == pytest.approx(500.0)  # only the new 5000 B: the 9000 stayed behind
    assert second.throttle_ms == 0
    # and putting the user quota back finds the old bucket with its history
    manager.set_quotas({QuotaEntity(USER, None): 500, QuotaEntity(DEFAULT, DEFAULT): 500})
    third = manager.record(USER, CLIENT, 1, 0)
    assert third.bucket == BucketKey(USER, "")
    assert third.throttle_ms == 8002  # 9001 B over 10 s against 500 B/s


def test_a_changed_bound_is_in_force_and_visible_at_once() -> None:
    """Kafka updates existing sensors' quotas when a quota changes; metrics read `bound`."""
    manager = ClientQuotaManager(QuotaType.PRODUCE)
    manager.set_quotas({QuotaEntity(USER, None): 1000})
    manager.record(USER, CLIENT, 100, 0)
    (bucket,) = manager.buckets.values()
    manager.set_quotas({QuotaEntity(USER, None): 250})
    assert (bucket.bound, bucket.applies) == (250, True)
    manager.set_quotas({QuotaEntity(None, CLIENT): 250})  # another key now: the old bucket has no bound
    assert bucket.applies is False
    assert manager.record(USER, CLIENT, 1, 0).bucket == BucketKey("", CLIENT)
