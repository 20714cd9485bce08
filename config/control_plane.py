"""The `[control_plane]` table: the fronted cluster as the fleet's control plane (issue 26).

Kafka 4 has no ZooKeeper, so a fleet keeps what it shares where Kafka Connect does, in the cluster it
fronts: quotas in a compacted topic (`[proxy] quota_store = "kafka"`, config/kafka_quotas.py) and
membership in a group of its own (`[fleet] membership = "kafka"`, proxy/fleet/kafka_group.py).
Every key is optional:

```toml
[proxy]
quota_store = "kafka"               # "file" (the default), "zookeeper" (implied by proxy.zookeeper)

[fleet]
membership = "kafka"                # the group kthrottle-fleet.<fleet name>

[control_plane]
quota_topic = "__kthrottle_quotas"  # created if absent: compacted, one partition, min(3, brokers) replicas
sasl_mechanism = "SCRAM-SHA-512"    # for a SASL listener: "PLAIN", "SCRAM-SHA-256" or "SCRAM-SHA-512"
sasl_username = "kthrottle"
sasl_password = "..."               # or $KTHROTTLE_CONTROL_PLANE_SASL_PASSWORD
```

The quota records are signed with the fleet secret, so the store needs a `[fleet]` table (a fleet of
one lists no peers). The cluster is `proxy.upstream`, with `[upstream_tls]` for TLS.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from .cluster_login import LOGIN_KEYS, ClusterLogin, parse_login
from .common import SettingsError

DEFAULT_TOPIC = "__kthrottle_quotas"
SASL_PASSWORD_ENV = "KTHROTTLE_CONTROL_PLANE_SASL_PASSWORD"
#: "file": the config file's [[quota]] tables and its *.admin.toml; "zookeeper": Kafka's znodes;
#: "kafka": the quota topic.
QUOTA_STORES = ("file", "zookeeper", "kafka")
#: Kafka's topic name rule (Topic.validate): at most 249 of [a-zA-Z0-9._-].
_TOPIC = re.compile(r"[a-zA-Z0-9._-]{1,249}")


@dataclass(frozen=True, slots=True)
class ControlPlaneSettings:
    """A checked `[control_plane]` table (see the module docstring)."""

    quota_topic: str = DEFAULT_TOPIC
    login: ClusterLogin = field(default_factory=ClusterLogin)


def parse_control_plane_table(table: object,
                              environ: Mapping[str, str] | None = None) -> ControlPlaneSettings:
    """A `[control_plane]` table, checked."""
    if not isinstance(table, Mapping):
        raise SettingsError(f"control_plane = {table!r} must be a table ([control_plane])")
    environ = os.environ if environ is None else environ
    topic = DEFAULT_TOPIC
    for key, value in dict(table).items():
        if key == "quota_topic":
            if not isinstance(value, str) or not _TOPIC.fullmatch(value) or value in (".", ".."):
                raise SettingsError(f"control_plane.quota_topic = {value!r} is not a Kafka topic name "
                                    "(1 to 249 of a-z, A-Z, 0-9, '.', '_', '-')")
            topic = value
        elif key not in LOGIN_KEYS:
            raise SettingsError(f"unknown setting control_plane.{key}")
    return ControlPlaneSettings(topic, parse_login("control_plane", dict(table), SASL_PASSWORD_ENV, environ))


__all__ = ["DEFAULT_TOPIC", "QUOTA_STORES", "SASL_PASSWORD_ENV", "ControlPlaneSettings",
           "parse_control_plane_table"]
