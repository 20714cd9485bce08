"""Kafka's ZooKeeper layout for quota configs: where each node lives and what a change notification
holds. Pure: strings and bytes in and out; the watching source is ``config/zookeeper.py``.

Why Kafka's layout: operators of ZooKeeper-era Kafka already have tooling, habits and data in it, and a
broker and a proxy (or many proxies) can read the same quotas. The nodes, under an optional chroot
(``/kafka`` ...), exactly as Kafka 3.x's ``AdminZkClient``/``ZkAdminManager`` wrote them:

    /config/users/<user>                              user entity
    /config/users/<user>/clients/<client-id>          (user, client-id) entity
    /config/clients/<client-id>                       client-id entity
    /config/ips/<ip>                                  ip entity (KIP-612), an address or <default>
    /config/client-id-prefix/<prefix>                 client-id prefix entity (kthrottle's extension)
    /config/users/<user>/client-id-prefix/<prefix>    (user, client-id prefix) entity (likewise)
    /config/changes/config_change_<seq>               change notifications for ZooKeeper-mode brokers

An entity's path below /config and its node data are Kafka's config form, shared with the Kafka topic
source (``config/config_form.py``): an ip entity's node is named by the address as Kafka names it (not
sanitized), a CIDR prefix, which Kafka does not have, writes its "/" as "%2F" (``ips/10.1.0.0%2F16``),
since a znode name cannot hold a "/". User and client-id names are sanitized in paths (Kafka's
``Sanitizer``); ``<default>`` names a default entity. Kafka has no client-id prefix entity: kthrottle keeps
its own under the name Redpanda's documentation uses (``client-id-prefix``), where a ZooKeeper-mode broker
never looks (and writes no change notification for them: a broker would read
``users/<u>/client-id-prefix/<p>`` as client id ``<p>`` of user ``<u>``). Node data is
``{"version":1,"config":{"producer_byte_rate":"1024","request_percentage":"50.0"}}``. User nodes also
hold SCRAM credentials (``SCRAM-SHA-256`` ...), which a reader ignores and a writer keeps.
"""

from __future__ import annotations

import json

#: Version field Kafka writes on change notifications (entity config nodes: ``CONFIG_VERSION``, 1).
NOTIFICATION_VERSION = 2
#: Kafka's ``ConfigEntityChangeNotificationSequenceZNode.SequenceNumberPrefix``.
CHANGE_PREFIX = "config_change_"
#: Kafka's brokers delete change notifications older than this (``ZkNodeChangeNotificationListener``); a
#: proxy that is the only writer does the same, or /config/changes would grow forever.
NOTIFICATION_EXPIRY_S = 15 * 60


def normalize_chroot(chroot: str) -> str:
    """``""``, ``"/"`` and ``"kafka/"`` become ``""``, ``""`` and ``"/kafka"``: a prefix to join paths to."""
    path = chroot.strip().strip("/")
    if not path:
        return ""
    if any(part in ("", ".", "..") for part in path.split("/")):
        raise ValueError(f'ZooKeeper chroot {chroot!r} is not a valid path like "/kafka"')
    return "/" + path


def config_root(chroot: str) -> str:
    """The ``/config`` node under a chroot as ``normalize_chroot`` gives it."""
    return f"{chroot}/config"


def changes_path(root: str) -> str:
    """Where change notifications go, under the ``/config`` node ``root``."""
    return f"{root}/changes"


def change_notification(relative: str) -> bytes:
    """The data of the change notification for the entity at ``relative`` (its path below /config)."""
    return json.dumps(
        {"version": NOTIFICATION_VERSION, "entity_path": relative},
        separators=(",", ":"),
        ensure_ascii=False,
    ).encode("utf-8")


def is_change_notification(name: str) -> bool:
    """Whether a child of /config/changes is a change notification (others are left alone)."""
    return name.startswith(CHANGE_PREFIX)


def client_of_user(relative: str) -> str | None:
    """The client-id (or client-id prefix) node name of a (user, client-id) entity's path, else None.

    Kafka (3.5+) deletes such a node's ``clients`` parent, and then the user node, when they are left
    empty (``tryCleanQuotaNodes``).
    """
    parts = relative.split("/")
    return parts[3] if len(parts) == 4 else None


__all__ = [
    "CHANGE_PREFIX", "NOTIFICATION_EXPIRY_S", "NOTIFICATION_VERSION", "change_notification", "changes_path",
    "client_of_user", "config_root", "is_change_notification", "normalize_chroot",
]
