"""``kthrottle local-kafka``: a local Apache Kafka cluster in the foreground, until interrupted.

It prints ``bootstrap=H:P,...`` (and the other listeners' bootstraps) on stdout once every broker is
ready, and stops every broker on SIGINT or SIGTERM, even during start-up.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from . import telemetry
from .broker_config import SASL_USERS
from .kafka_jars import KAFKA_VERSION
from .local_kafka import DEFAULT_HEAP_MB, LocalKafka


def build_parser() -> argparse.ArgumentParser:
    """The options of ``kthrottle local-kafka``."""
    parser = argparse.ArgumentParser(
        prog="kthrottle local-kafka",
        description=f"Run a local Apache Kafka {KAFKA_VERSION} KRaft cluster on 127.0.0.1 until interrupted.",
    )
    parser.add_argument("--brokers", type=int, default=3, help="number of nodes (default: 3)")
    parser.add_argument("--sasl", action="store_true", help="add a SASL_PLAINTEXT listener (PLAIN, SCRAM)")
    parser.add_argument("--tls", action="store_true",
                        help="add SSL and SASL_SSL listeners, with test certificates generated at start")
    parser.add_argument("--telemetry", action="store_true",
                        help="record client telemetry (KIP-714) pushes, with a subscription to every metric "
                             f"each {telemetry.PUSH_INTERVAL_MS} ms")
    parser.add_argument("--heap-mb", type=int, default=DEFAULT_HEAP_MB,
                        help=f"JVM heap per node in MiB (default: {DEFAULT_HEAP_MB}, Kafka's own default; "
                             "enough for thousands of topics, as librdkafka's test suite creates)")
    parser.add_argument("--timeout", type=float, default=120.0, help="startup timeout in seconds")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run a local cluster in the foreground until SIGINT/SIGTERM (``kthrottle local-kafka``)."""
    args = build_parser().parse_args(argv)

    stop = threading.Event()
    interrupt_startup = [True]  # a signal during start() aborts it (start() kills what it launched), once

    def _on_signal(signum: int, _frame: object) -> None:
        stop.set()
        if interrupt_startup[0]:
            interrupt_startup[0] = False
            raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, _on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    cluster = LocalKafka(brokers=args.brokers, sasl=args.sasl, heap_mb=args.heap_mb, tls=args.tls,
                         telemetry=args.telemetry)
    code = 0
    try:
        print(f"starting {args.brokers} Kafka {KAFKA_VERSION} node(s)...", file=sys.stderr, flush=True)
        cluster.start(timeout=args.timeout)
        if args.telemetry:
            cluster.subscribe_client_metrics(timeout=args.timeout)
        interrupt_startup[0] = False
        print(f"bootstrap={cluster.bootstrap}")
        if cluster.sasl_bootstrap:
            print(f"sasl_bootstrap={cluster.sasl_bootstrap}")
        if cluster.certificates is not None:
            print(f"ssl_bootstrap={cluster.ssl_bootstrap}")
            print(f"sasl_ssl_bootstrap={cluster.sasl_ssl_bootstrap}")
            print(f"certificates={cluster.certificates.directory}")
        if args.telemetry:
            assert cluster.workdir is not None
            print(f"telemetry={cluster.workdir}/node-*/telemetry.tsv")
        sys.stdout.flush()
        users = ", ".join(f"{u}/{p}" for u, p in SASL_USERS.items())
        print(
            f"ready in {cluster.startup_seconds:.1f}s; logs in {cluster.workdir}"
            + (f"; SASL users {users}" if args.sasl or args.tls else ""),
            file=sys.stderr,
            flush=True,
        )
        while not stop.wait(1.0):
            if not cluster.alive():
                print(f"a Kafka node exited; stopping\n{cluster.logs_tail()}", file=sys.stderr, flush=True)
                code = 1
                break
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        code = 1
    except KeyboardInterrupt:
        print("interrupted during startup", file=sys.stderr, flush=True)
        code = 130
    finally:
        cluster.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code


if __name__ == "__main__":
    sys.exit(main())
