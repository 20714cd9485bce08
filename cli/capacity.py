"""`kthrottle capacity`: the fleet's cluster capacity, kept in the quota topic (issue 26).

Why not through the admin API like `kthrottle quotas`: Kafka's client-quota APIs have no entity
for a cluster-wide setting, and the capacity is the fleet operator's, not a tenant admin's. So this
command writes the topic itself, with what a member has: run it with a member's config file (its
upstream, `[upstream_tls]`, `[control_plane]` login and fleet secret). Every member applies the
change within a second, without a restart; `delete` with no keys removes the record, and each
member's own `[capacity]` table applies again.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from config.capacity import capacity_from_config_form
from config.cluster_login import client_configs
from config.common import SettingsError
from config.kafka_quotas import KafkaQuotaError, KafkaQuotas
from config.settings import load_settings, parse_address_list


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, required=True,
                        help='a member\'s config file (proxy.quota_store = "kafka")')
    parser.add_argument("--upstream", help="the cluster, H:P[,H:P] (default: the file's proxy.upstream)")
    actions = parser.add_subparsers(dest="action", required=True)
    actions.add_parser("describe", help="show the capacity in the quota topic")
    setting = actions.add_parser("set", help="set KEY=VALUE keys of the capacity (a [capacity] table's)")
    setting.add_argument("values", nargs="+", metavar="KEY=VALUE",
                         help="e.g. produce_byte_rate=50000000 adaptive=true")
    removing = actions.add_parser("delete", help="remove keys (all, when none are named: the record)")
    removing.add_argument("keys", nargs="*", metavar="KEY")


def run_command(args: argparse.Namespace) -> int:
    settings = load_settings(args.config)
    if args.upstream:
        settings.upstream = parse_address_list(args.upstream, "--upstream")
    if not settings.upstream:
        raise SettingsError(f"{args.config} has no proxy.upstream: name the cluster with --upstream")
    if settings.quota_store != "kafka" or settings.fleet is None:
        raise SettingsError(f"{args.config}: the capacity lives in the quota topic only with "
                            'proxy.quota_store = "kafka" (elsewhere, edit the [capacity] table and restart)')
    changes: dict[str, str | None] = {}
    if args.action == "set":
        for item in args.values:
            key, sep, value = item.partition("=")
            if not sep or not key or not value:
                raise SettingsError(f"{item!r} is not KEY=VALUE")
            changes[key] = value
    tls = None
    if settings.upstream_tls is not None:
        from proxy.tls import TlsContexts

        contexts = TlsContexts(None, settings.upstream_tls)
        tls = contexts.upstream.current if contexts.upstream is not None else None
    configs = client_configs(settings.upstream, tls, settings.control_plane.login, "kthrottle-capacity",
                             request_timeout_ms=10_000, bootstrap_timeout_ms=10_000)
    store = KafkaQuotas(configs, settings.fleet.secret, topic=settings.control_plane.quota_topic,
                        on_change=lambda _table: None)
    try:
        store.start()
        current = store.current_capacity()
        if args.action == "set":
            current = store.alter_capacity(changes)
        elif args.action == "delete":
            keys = args.keys or list(current or {})
            current = store.alter_capacity(dict.fromkeys(keys))
    except KafkaQuotaError as exc:
        raise SettingsError(str(exc)) from exc
    finally:
        store.stop()
    if current is None:
        print("no capacity in the quota topic: each member's own [capacity] table applies")
        return 0
    capacity_from_config_form(current)  # what the members apply (the store checked it)
    for key, value in sorted(current.items()):
        print(f"{key} = {value}")
    return 0


__all__ = ["add_arguments", "run_command"]
