"""The `kthrottle` command: `run` (the proxy) and `local-kafka` (a real local cluster)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import uvloop

from cli import process_memory
from config.common import BindError
from config.settings import ProxySettings, SettingsError, load_settings, parse_address, parse_address_list
from proxy.observability.logs import RepeatSummary
from proxy.observability.logs import install as install_log_summary

if TYPE_CHECKING:
    from config.store import FileQuotaStore
    from proxy.admin.quota_admin import QuotaStore
    from proxy.server import ProxyServer
    from quotas.engine import QuotaTable

log = logging.getLogger("kthrottle")


def _settings_from_args(args: argparse.Namespace) -> ProxySettings:
    settings = load_settings(args.config)
    if args.upstream:
        settings.upstream = parse_address_list(args.upstream, "--upstream")
    if args.listen:
        settings.listen = parse_address(args.listen, "--listen")
    if args.advertised_host:
        settings.advertised_host = args.advertised_host
    if args.metrics_port is not None:
        settings.metrics_port = args.metrics_port
    if args.node_port_base is not None:
        settings.node_port_base = args.node_port_base
    from proxy.supervisor.workers import configure_worker

    configure_worker(settings)  # a worker of `run --workers N`: shared listeners, a fleet of siblings
    return settings


#: How often the quota file and its admin file are checked for changes.
QUOTA_FILE_POLL_SECONDS = 0.5


def _read_quota_file(settings: ProxySettings, server: ProxyServer) -> QuotaTable:
    """The file's [[quota]] tables, for a store that keeps quotas elsewhere; its partition throttles
    (not client quotas: they stay in the file) are applied, read at start."""
    from config.partition_throttles import load_partition_throttles
    from config.quotas import QuotaConfigError, load_quota_file

    if settings.quota_file is None:
        return {}
    try:
        in_file = load_quota_file(settings.quota_file)
        server.partition_throttles.set_throttles(load_partition_throttles(settings.quota_file))
    except QuotaConfigError as exc:
        raise SettingsError(str(exc)) from exc
    return in_file


async def _open_quota_store(settings: ProxySettings, server: ProxyServer) -> QuotaStore | None:
    """The quota topic, ZooKeeper or the quota file (and its admin file), as proxy.quota_store says;
    none without a config file."""
    from config.quotas import QuotaConfigError
    from config.store import FileQuotaStore

    loop = asyncio.get_running_loop()
    if settings.quota_store == "kafka":
        from proxy.admin.kafka_store import open_kafka_quotas

        # the file's quotas serve only while the topic cannot be read at start
        return await open_kafka_quotas(settings, server, _read_quota_file(settings, server))
    if settings.zookeeper:
        from config.zookeeper import ZooKeeperQuotaError, ZooKeeperQuotas

        if _read_quota_file(settings, server):
            raise SettingsError(
                f"{settings.quota_file} has [[quota]] tables, but proxy.zookeeper is set, so quotas live "
                "in ZooKeeper: set them there (kafka-configs or kthrottle quotas) and remove the tables")

        def from_zookeeper(table: QuotaTable) -> None:  # called on kazoo's thread
            loop.call_soon_threadsafe(_apply_from_zookeeper, server, table)

        zk = ZooKeeperQuotas(settings.zookeeper, settings.zookeeper_chroot, on_change=from_zookeeper)
        try:
            await loop.run_in_executor(None, zk.start)
        except ZooKeeperQuotaError as exc:
            raise SettingsError(str(exc)) from exc
        log.info("quotas live in ZooKeeper %s%s", settings.zookeeper, settings.zookeeper_chroot)
        return zk
    if settings.quota_file is not None:
        store = FileQuotaStore(settings.quota_file, on_change=server.engine.set_quotas,
                               on_partition_throttles=server.partition_throttles.set_throttles)
        try:
            store.start()
        except QuotaConfigError as exc:
            raise SettingsError(f"invalid quotas: {exc}") from exc
        return store
    return None


def _apply_from_zookeeper(server: ProxyServer, table: QuotaTable) -> None:
    server.engine.set_quotas(table)
    log.info("quotas from ZooKeeper: %d entit%s", len(table), "y" if len(table) == 1 else "ies")


async def _watch_quota_files(store: FileQuotaStore) -> None:
    """Apply edits to the quota file without a signal (SIGHUP still forces a reload)."""
    while True:
        await asyncio.sleep(QUOTA_FILE_POLL_SECONDS)
        store.poll()


#: How often quota buckets are expired (see QuotaEngine.expire_idle) and repeated log lines summarised.
HOUSEKEEPING_SECONDS = 1.0


#: After the request memory pool held this much and drained, free memory goes back to the system.
TRIM_AFTER_BYTES = 32 * 1024 * 1024


async def _housekeeping(server: ProxyServer, summary: RepeatSummary) -> None:
    """Expire quota buckets whose history has passed, look up throttled topics' unknown ids,
    summarise repeated log lines, pick up rotated TLS certificates (new connections get them;
    proxy/tls.py), and give memory back after a spike of large requests (glibc keeps freed memory
    otherwise: process_memory.tune_malloc); write shadow mode's "would throttle" lines."""
    from proxy.observability.shadow_log import SHADOW_LOG_SECONDS, write_shadow_log

    shadow_due = time.monotonic() + SHADOW_LOG_SECONDS
    while True:
        await asyncio.sleep(HOUSEKEEPING_SECONDS)
        server.engine.expire_idle(int(time.monotonic() * 1000))
        if time.monotonic() >= shadow_due:
            shadow_due += SHADOW_LOG_SECONDS
            write_shadow_log(server.shadow_log)
        server.topic_ids.poll(time.monotonic())
        if server.tls is not None:
            server.tls.poll()
        summary.flush()
        pool = server.memory
        if pool.peak >= TRIM_AFTER_BYTES and pool.used < TRIM_AFTER_BYTES // 4:
            pool.peak = pool.used
            process_memory.trim_malloc()


def _reload(store: FileQuotaStore | None, server: ProxyServer) -> None:
    """SIGHUP: read the quota file and the TLS certificate files now."""
    if store is not None:
        store.reload()
    if server.tls is not None:
        server.tls.poll(force=True)


async def serve(settings: ProxySettings, ready_message: str | None = None, demo: bool = False) -> None:
    """Run the proxy until SIGINT or SIGTERM; SIGHUP reloads the quota file and the TLS files."""
    from config.store import FileQuotaStore
    from proxy.server import ProxyServer

    server = ProxyServer(settings)
    store = await _open_quota_store(settings, server)
    server.quota_admin.store = store
    fleet = None
    if settings.fleet is not None:  # before the listeners: clients meet a proxy that knows its peers
        from proxy.fleet.start import start_fleet

        fleet = await start_fleet(settings, server)
    usage_writer = None
    if settings.usage is not None:  # counts from here: the listeners are not open yet
        from proxy.observability.usage_event_schema import proxy_identity
        from proxy.observability.usage_events import UsageEventWriter

        member = None if fleet is None else (f"{fleet.sender:016x}", fleet.name)
        identity = proxy_identity(settings, settings.listen, *(member or (None, None)))
        usage_writer = UsageEventWriter(settings.usage, settings, server.engine, server.metrics.registry,
                                        server.upstream_tls_context, identity)
        usage_writer.start()
    endpoint = None
    if settings.metrics_port:
        from proxy.observability.http_endpoint import HttpEndpoint

        async def refresh() -> None:
            await server.metrics.quotas.refresh()
            server.partition_throttle_metrics.refresh()
            server.connection_metrics.refresh()
            if server.capacity_metrics is not None:
                server.capacity_metrics.refresh(int(time.monotonic() * 1000))

        from proxy.observability.connections import ConnectionsView
        from proxy.supervisor.workers import worker_index

        # /connections: this process's own connections (with --workers, each worker's port its own)
        connections = ConnectionsView(server.sessions, worker_index())
        endpoint = HttpEndpoint(server.metrics.registry, refresh, server.ready, connections.answer)
        try:
            await endpoint.start(None, settings.metrics_port)  # every interface, as before
        except OSError as exc:
            index = worker_index()
            setting = f"metrics_port + {index}, for worker {index}" if index else "metrics_port"
            raise BindError(("0.0.0.0", settings.metrics_port), setting, exc) from exc
        print(f"kthrottle: metrics on http://127.0.0.1:{settings.metrics_port}/metrics "
              "(health: /healthz, /ready; connections: /connections)", flush=True)
    await server.start()
    process_memory.freeze_start_up_objects()
    # The signals are handled before the line that says the proxy is up: a supervisor (or a test)
    # may send SIGHUP as soon as it reads it, and until the handler is there SIGHUP's default
    # action ends the process (h46: a proxy preempted between the two on a busy machine).
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    file_store = store if isinstance(store, FileQuotaStore) else None
    if file_store is not None or server.tls is not None:
        loop.add_signal_handler(signal.SIGHUP, _reload, file_store, server)
    host, port = server.bootstrap_address
    protocol = " with security.protocol=SSL (or SASL_SSL)" if settings.tls is not None else ""
    print(f"kthrottle: clients use bootstrap.servers={host}:{port}{protocol}", flush=True)
    if ready_message:
        print(ready_message, flush=True)
    demo_producer = None
    if demo:
        from harness.demo import DemoProducer

        demo_producer = DemoProducer(f"{host}:{port}")
        demo_producer.start()
        print("kthrottle: demo traffic: a producer with client.id=demo is running (see its log lines)",
              flush=True)
    summary = install_log_summary()
    tasks = [loop.create_task(_housekeeping(server, summary))]
    if file_store is not None:
        tasks.append(loop.create_task(_watch_quota_files(file_store)))
    await stop.wait()
    for task in tasks:
        task.cancel()
    if store is not None:
        await loop.run_in_executor(None, store.stop)
    if demo_producer is not None:
        await asyncio.get_running_loop().run_in_executor(None, demo_producer.stop)
    if endpoint is not None:
        await endpoint.close()
    if fleet is not None:
        await fleet.close()
    await server.close()
    if usage_writer is not None:  # after the listeners: the last interval has every request
        await usage_writer.close()
    summary.flush(force=True)


def _fatal(exc: Exception) -> None:
    """The one line saying why `run` stops at start: to the supervisor in a worker of
    `run --workers N` (it prints it once for all workers), else to stderr."""
    from proxy.supervisor.workers import report_fatal

    if not report_fatal(str(exc)):
        print(f"kthrottle: {exc}", file=sys.stderr, flush=True)


def cmd_run(args: argparse.Namespace) -> int:
    """Exit codes: 0 after SIGINT/SIGTERM, 2 for a setting refused, 3 for a port that cannot be
    bound (proxy/supervisor/workers.py: SETTINGS_ERROR_EXIT, BIND_ERROR_EXIT)."""
    from proxy.supervisor.workers import BIND_ERROR_EXIT, SETTINGS_ERROR_EXIT

    try:
        settings = _settings_from_args(args)
    except SettingsError as exc:
        _fatal(exc)
        return SETTINGS_ERROR_EXIT
    with contextlib.ExitStack() as stack:
        note = None
        if not settings.upstream:
            from harness.local_kafka import LocalKafka

            print("kthrottle: no upstream configured; starting an embedded local Kafka cluster "
                  "(3 brokers, KRaft)...", flush=True)
            cluster = stack.enter_context(LocalKafka(brokers=3))
            settings.upstream = parse_address_list(cluster.bootstrap, "embedded cluster")
            note = f"kthrottle: embedded cluster (direct, for comparison) at {cluster.bootstrap}"
        process_memory.tune_malloc()
        if args.workers != 1:
            from proxy.supervisor.workers import supervise

            return supervise(args, settings)
        try:
            uvloop.run(serve(settings, note, demo=args.demo))
        except SettingsError as exc:
            _fatal(exc)
            return SETTINGS_ERROR_EXIT
        except BindError as exc:
            _fatal(exc)
            return BIND_ERROR_EXIT
    return 0


def _cmd_capacity(args: argparse.Namespace) -> int:
    from cli.capacity import run_command
    from proxy.supervisor.workers import SETTINGS_ERROR_EXIT

    try:
        return run_command(args)
    except SettingsError as exc:
        _fatal(exc)
        return SETTINGS_ERROR_EXIT


def _cmd_quotas(args: argparse.Namespace) -> int:
    from cli.quotas import run_command

    return run_command(args)


def _cmd_usage_report(args: argparse.Namespace) -> int:
    from reports.usage_report import run_command

    return run_command(args)


def _cmd_top(args: argparse.Namespace) -> int:
    from top.app import run as run_top

    return run_top(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kthrottle", description="Kafka-protocol throttling proxy")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the proxy (with an embedded cluster when no upstream is set)")
    run.add_argument("--config", type=Path,
                     help="TOML file with [proxy] settings and [[quota]] tables (SIGHUP reloads the quotas)")
    run.add_argument("--upstream", help="the cluster's bootstrap servers, H:P[,H:P...]")
    run.add_argument("--listen", help="bootstrap listener H:P (default 127.0.0.1:9192)")
    run.add_argument("--advertised-host", help="host clients are told to connect to")
    run.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    run.add_argument("--node-port-base", type=int,
                     help="broker node N is served on this port + N (default: listen port + 1)")
    run.add_argument("--demo", action="store_true",
                     help="also run a demo producer (client.id=demo) through the proxy")
    run.add_argument("--workers", type=int, default=1,
                     help="processes sharing the listeners, enforcing one quota as a fleet (default 1)")
    run.set_defaults(func=cmd_run)

    local = sub.add_parser("local-kafka", help="run a real local Kafka cluster in the foreground")
    local.add_argument("--brokers", type=int, default=3)
    local.add_argument("--sasl", action="store_true", help="add a SASL_PLAINTEXT listener with users")
    local.add_argument("--tls", action="store_true",
                       help="add SSL and SASL_SSL listeners (a test CA and certificates are generated)")
    local.add_argument("--telemetry", action="store_true",
                       help="record the client telemetry (KIP-714) brokers receive, every metric each second")
    local.set_defaults(func=None)

    quotas = sub.add_parser("quotas",
                            help="describe, set or delete quotas through a running proxy's admin API")
    quotas.add_argument("--bootstrap-server", required=True, help="the proxy's address, H:P")
    quotas.add_argument("--sasl-mechanism", choices=["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"],
                        help="authenticate as --sasl-username (SASL_PLAINTEXT, or SASL_SSL with --tls-ca)")
    quotas.add_argument("--sasl-username")
    quotas.add_argument("--sasl-password", default=os.environ.get("KTHROTTLE_SASL_PASSWORD"),
                        help="(default: $KTHROTTLE_SASL_PASSWORD)")
    quotas.add_argument("--tls-ca", type=Path,
                        help="connect over TLS, verifying the proxy's certificate against this CA (PEM)")
    quotas.add_argument("--tls-certificate", type=Path,
                        help="present this client certificate (PEM): the principal its subject maps to")
    quotas.add_argument("--tls-key", type=Path, help="the client certificate's private key (PEM)")
    actions = quotas.add_subparsers(dest="action", required=True)
    for name, text in (("describe", "show quotas (all, or those of the entity given)"),
                       ("set", "set KEY=VALUE quotas on an entity"),
                       ("delete", "remove quota keys from an entity (all of them when none are named)")):
        action = actions.add_parser(name, help=text)
        user = action.add_mutually_exclusive_group()
        user.add_argument("--user", help="a user principal name")
        user.add_argument("--default-user", action="store_true", help="the <default> user")
        client = action.add_mutually_exclusive_group()
        client.add_argument("--client-id")
        client.add_argument("--default-client-id", action="store_true", help="the <default> client-id")
        client.add_argument("--client-id-prefix", metavar="PREFIX",
                            help="every client id starting with PREFIX (Redpanda's client-id-prefix entity)")
        if name == "set":
            action.add_argument("quotas", nargs="+", metavar="KEY=VALUE",
                                help="e.g. producer_byte_rate=1048576 request_percentage=50")
            action.add_argument("--validate-only", action="store_true")
        elif name == "delete":
            action.add_argument("keys", nargs="*", metavar="KEY")
    quotas.set_defaults(func=_cmd_quotas)

    capacity = sub.add_parser("capacity", help="describe, set or delete the fleet's cluster capacity in the "
                                               "quota topic (with a member's config file)")
    from cli.capacity import add_arguments as add_capacity_arguments

    add_capacity_arguments(capacity)
    capacity.set_defaults(func=_cmd_capacity)

    top = sub.add_parser("top", help="live terminal view of running proxies: tenants by rate against "
                                     "their quotas, throttle time, muted connections")
    from top.app import add_arguments as add_top_arguments

    add_top_arguments(top)
    top.set_defaults(func=_cmd_top)

    from reports.usage_report import add_arguments as add_usage_report_arguments  # no pyspark import

    report = sub.add_parser("usage-report",
                            help="per-tenant, per-hour usage from the usage topic, on Spark (local mode)")
    add_usage_report_arguments(report)
    report.set_defaults(func=_cmd_usage_report)

    args, rest = parser.parse_known_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("kafka").setLevel(logging.CRITICAL)  # the demo's client library: its own noise
    if args.command == "local-kafka":
        from harness import local_kafka_cli

        forwarded = ([f"--brokers={args.brokers}"] + (["--sasl"] if args.sasl else [])
                     + (["--tls"] if args.tls else []) + (["--telemetry"] if args.telemetry else []) + rest)
        return local_kafka_cli.main(forwarded)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
