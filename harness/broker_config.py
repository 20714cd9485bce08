"""What each local Kafka node is told: its listeners and ports, SASL users, TLS files and server.properties.

Why a module of its own: the cluster's lifecycle (format, launch, wait, stop) in ``local_kafka`` does not
change when a listener or a broker setting does, and the settings are easier to review in one place.
Pure text building, no processes.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping
from pathlib import Path

from .certificates import TestCertificates

HOST = "127.0.0.1"
"""Every node listens on loopback only."""

SASL_USERS: dict[str, str] = {
    "admin": "admin-secret",
    "alice": "alice-secret",
    "bob": "bob-secret",
}
"""Users known to the SASL_PLAINTEXT and SASL_SSL listeners, for PLAIN and both SCRAM mechanisms alike."""

SCRAM_MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512")
SASL_MECHANISMS = ("PLAIN", *SCRAM_MECHANISMS)

LISTENERS = ("PLAINTEXT", "SASL_PLAINTEXT", "SSL", "SASL_SSL")
"""The client listeners a node can have, named (as in Kafka) after their security protocol."""

SSL_PRINCIPAL_MAPPING_RULES = "RULE:^CN=([^,]+),.*$/$1/,DEFAULT"
"""The brokers' ``ssl.principal.mapping.rules``: a client certificate "CN=alice,OU=eng,O=kthrottle" is
User:alice, the same principal as the SASL user alice; a DN the rule does not match stays the whole DN."""
SSL_CLIENT_AUTH = "requested"
"""``ssl.client.auth`` of the SSL listener: a client certificate gives the principal, none gives ANONYMOUS."""

# Log4j2 config for the brokers: INFO to stdout, which the harness sends to node-<id>/server.log (one writer,
# so JVM crash messages and log lines stay in order). The request logger is silenced: it logs every request.
BROKER_LOG4J2 = """\
status = warn
appender.out.type = Console
appender.out.name = OUT
appender.out.target = SYSTEM_OUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c{1})%n
rootLogger.level = ${sys:kthrottle.log.level:-info}
rootLogger.appenderRef.out.ref = OUT
logger.request.name = kafka.request.logger
logger.request.level = warn
logger.clients.name = org.apache.kafka.clients
logger.clients.level = warn
"""


def jaas_plain() -> str:
    """The PLAIN listener's JAAS line: the broker logs in as the first user and knows every user."""
    users = " ".join(f'user_{name}="{password}"' for name, password in SASL_USERS.items())
    admin = next(iter(SASL_USERS))
    return (
        "org.apache.kafka.common.security.plain.PlainLoginModule required "
        f'username="{admin}" password="{SASL_USERS[admin]}" {users};'
    )


class Node:
    """One combined broker+controller JVM: its ports and, once launched, its process."""

    def __init__(self, node_id: int, ports: list[int], sasl: bool, tls: bool = False) -> None:
        self.node_id = node_id
        self.client_port, self.internal_port, self.controller_port = ports[:3]
        rest = iter(ports[3:])
        self.sasl_port: int | None = next(rest) if sasl else None
        self.ssl_port: int | None = next(rest) if tls else None
        self.sasl_ssl_port: int | None = next(rest) if tls else None
        self.proc: subprocess.Popen[bytes] | None = None
        self.recording: Path | None = None  # this JVM records the class archive at exit


def server_properties(
    node: Node,
    nodes: list[Node],
    node_dir: Path,
    *,
    certificates: TestCertificates | None,
    extra: Mapping[str, str | int] | None = None,
) -> str:
    """One node's server.properties; the small thread counts and partition counts suit a 2-core test machine.

    A SASL_PLAINTEXT listener exists when the node has a SASL port; SSL and SASL_SSL when ``certificates``
    are given. ``extra`` settings (metric reporters, say) come last and win.
    """
    sasl = node.sasl_port is not None
    tls = certificates is not None
    rf = min(3, len(nodes))
    voters = ",".join(f"{n.node_id}@{HOST}:{n.controller_port}" for n in nodes)
    listeners = [
        f"PLAINTEXT://{HOST}:{node.client_port}",
        f"INTERNAL://{HOST}:{node.internal_port}",
        f"CONTROLLER://{HOST}:{node.controller_port}",
    ]
    advertised = listeners[:2]
    if node.sasl_port is not None:
        sasl_listener = f"SASL_PLAINTEXT://{HOST}:{node.sasl_port}"
        listeners.append(sasl_listener)
        advertised.append(sasl_listener)
    protocol_map = (
        "PLAINTEXT:PLAINTEXT,INTERNAL:PLAINTEXT,CONTROLLER:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT"
    )
    if tls:
        tls_listeners = [f"SSL://{HOST}:{node.ssl_port}", f"SASL_SSL://{HOST}:{node.sasl_ssl_port}"]
        listeners += tls_listeners
        advertised += tls_listeners
        protocol_map += ",SSL:SSL,SASL_SSL:SASL_SSL"
    props: dict[str, str | int] = {
        "process.roles": "broker,controller",
        "node.id": node.node_id,
        "controller.quorum.voters": voters,
        "controller.listener.names": "CONTROLLER",
        "listeners": ",".join(listeners),
        "advertised.listeners": ",".join(advertised),
        "listener.security.protocol.map": protocol_map,
        "inter.broker.listener.name": "INTERNAL",
        "log.dirs": str(node_dir / "data"),
        "num.network.threads": 2,
        "num.io.threads": 2,
        "background.threads": 2,
        "num.replica.fetchers": 1,
        "num.recovery.threads.per.data.dir": 1,
        "log.cleaner.threads": 1,
        "num.partitions": 1,
        "default.replication.factor": 1,
        "auto.create.topics.enable": "false",
        "offsets.topic.replication.factor": rf,
        "offsets.topic.num.partitions": 10,
        "transaction.state.log.replication.factor": rf,
        "transaction.state.log.min.isr": 1,
        "transaction.state.log.num.partitions": 10,
        "share.coordinator.state.topic.replication.factor": rf,
        "share.coordinator.state.topic.min.isr": 1,
        "group.initial.rebalance.delay.ms": 0,
        "broker.heartbeat.interval.ms": 500,
        "log.segment.bytes": 64 * 1024 * 1024,
        # Keep every record for the cluster's life: tests write records with fixed old timestamps
        # (2023), which the default 7-day retention would delete whenever its 5-minute check fell
        # mid-test, leaving a reader OFFSET_OUT_OF_RANGE.
        "log.retention.ms": -1,
    }
    sasl_listeners = [name for name, on in (("sasl_plaintext", sasl), ("sasl_ssl", tls)) if on]
    if sasl_listeners:
        props["sasl.enabled.mechanisms"] = ",".join(SASL_MECHANISMS)
    for listener in sasl_listeners:
        props[f"listener.name.{listener}.plain.sasl.jaas.config"] = jaas_plain()
        for mech in SCRAM_MECHANISMS:
            props[f"listener.name.{listener}.{mech.lower()}.sasl.jaas.config"] = (
                "org.apache.kafka.common.security.scram.ScramLoginModule required;"
            )
    if certificates is not None:
        props.update(tls_properties(certificates))
    if extra:
        props.update(extra)
    return "".join(f"{key}={value}\n" for key, value in props.items())


def tls_properties(certs: TestCertificates) -> dict[str, str | int]:
    """The SSL and SASL_SSL listeners' keystore and truststore, as PEM files (KIP-651).

    A PEM keystore is one file with the PKCS#8 key and the certificate chain; with the key unencrypted
    neither ``ssl.key.password`` nor a keystore password is set (Kafka refuses a keystore password for
    PEM). Only the SSL listener asks for client certificates: that is where a certificate is the identity.
    """
    props: dict[str, str | int] = {"ssl.principal.mapping.rules": SSL_PRINCIPAL_MAPPING_RULES}
    for listener in ("ssl", "sasl_ssl"):
        prefix = f"listener.name.{listener}."
        props[prefix + "ssl.keystore.type"] = "PEM"
        props[prefix + "ssl.keystore.location"] = str(certs.server_keystore)
        props[prefix + "ssl.truststore.type"] = "PEM"
        props[prefix + "ssl.truststore.location"] = str(certs.ca)
    props["listener.name.ssl.ssl.client.auth"] = SSL_CLIENT_AUTH
    return props
