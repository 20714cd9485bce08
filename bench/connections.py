"""`python -m bench.connections`: what new connections cost through the proxy (issue 20), in one run.

One real broker with PLAINTEXT and SSL listeners, and in front of it:

    direct          client -> broker
    relay           client -> a bare TCP relay (tests/integration/tcp_relay.py) -> broker
    proxy           client -> kthrottle, no IP quota
    proxy-ip-quota  client -> kthrottle with an ip <default> quota it never reaches (every
                    connection charged to its address's bucket: the cost of the check)

Each path gets a storm from one address (tests/integration/storms.py: connect, ApiVersions, answer,
close, as fast as it goes) and reports connections served per second and the proxy's CPU per
connection. Then a storm against a TLS listener (the proxy with `[tls]`): once with an IP quota
that refuses the storming address (it is throttled before the handshake, so the proxy spends no
handshake on it) and once without (every connection completes a TLS handshake), with the proxy's
CPU per connection in each; the broker's own SSL listener gives the direct figure beside them.
Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import ssl
import statistics
import sys
import tempfile
import time
from pathlib import Path

from harness.local_kafka import KAFKA_VERSION, LocalKafka
from tests.integration.proxies import RunningProxy
from tests.integration.storms import storm
from tests.integration.tcp_relay import TcpRelay

from . import cpu

Address = tuple[str, int]
STORM_SOURCE = "127.0.0.2"


def _address(bootstrap: str) -> Address:
    host, port = bootstrap.rsplit(":", 1)
    return host, int(port)


def _measure(target: Address, seconds: float, pid: int | None,
             concurrency: int) -> tuple[float, float | None]:
    """(connections served per second, proxy CPU ms per connection attempted)."""
    window = cpu.CpuWindow.open(pid if pid is not None else os.getpid())
    result = storm(target, STORM_SOURCE, seconds, concurrency=concurrency)
    usage = window.close()
    per_connection = (usage.process_cpu_s * 1000.0 / result.total
                      if pid is not None and result.total and usage.process_cpu_s is not None else None)
    return result.served / seconds, per_connection


async def _tls_storm_async(target: Address, context: ssl.SSLContext, seconds: float, concurrency: int,
                           source: str) -> tuple[int, int]:
    """(handshakes completed, connections closed or failed) of a storm of TLS connects."""
    deadline = time.monotonic() + seconds
    done = failed = 0

    async def one() -> None:
        nonlocal done, failed
        while time.monotonic() < deadline:
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(
                    *target, ssl=context, server_hostname="localhost", local_addr=(source, 0)), 3.0)
            except (OSError, TimeoutError, ssl.SSLError):
                failed += 1
                continue
            done += 1
            writer.close()
            with contextlib.suppress(OSError, ssl.SSLError):
                await writer.wait_closed()

    await asyncio.gather(*(one() for _ in range(concurrency)))
    return done, failed


def _tls_measure(target: Address, context: ssl.SSLContext, seconds: float, pid: int | None,
                 concurrency: int) -> tuple[float, float, float | None]:
    """(handshakes per second, connections refused per second, CPU ms per connection of `pid`)."""
    window = cpu.CpuWindow.open(pid if pid is not None else os.getpid())
    done, failed = asyncio.run(_tls_storm_async(target, context, seconds, concurrency, STORM_SOURCE))
    usage = window.close()
    total = done + failed
    per = (usage.process_cpu_s * 1000.0 / total
           if pid is not None and total and usage.process_cpu_s is not None else None)
    return done / seconds, failed / seconds, per


def _fmt(value: float | None, unit: str) -> str:
    return "n/a" if value is None else f"{value:.3f} {unit}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.connections", description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each storm")
    parser.add_argument("--rounds", type=int, default=3, help="storms per path, alternating")
    parser.add_argument("--concurrency", type=int, default=32, help="connections in flight per storm")
    args = parser.parse_args(argv)
    began = time.monotonic()
    print(f"starting 1 Kafka {KAFKA_VERSION} broker with an SSL listener...", flush=True)
    with (LocalKafka(brokers=1, tls=True) as cluster,
          tempfile.TemporaryDirectory(prefix="kthrottle-bench-conn-") as tmp):
        certificates = cluster.certificates
        assert certificates is not None and cluster.ssl_bootstrap is not None
        work = Path(tmp)
        quota_config = work / "ip-quota.toml"
        quota_config.write_text('[[quota]]\nip = "<default>"\nconnection_creation_rate = 1000000\n')
        tls_config = work / "tls.toml"
        tls_config.write_text(f'[tls]\ncertificate = "{certificates.server_cert}"\n'
                              f'key = "{certificates.server_key}"\n')
        refusing = work / "tls-refusing.toml"
        refusing.write_text(tls_config.read_text()
                            + f'\n[[quota]]\nip = "{STORM_SOURCE}"\nconnection_creation_rate = 1\n')
        relay = TcpRelay(_address(cluster.bootstrap))
        proxies = {
            "proxy": RunningProxy(cluster.bootstrap),
            "proxy-ip-quota": RunningProxy(cluster.bootstrap, extra_args=["--config", str(quota_config)]),
            "proxy-tls": RunningProxy(cluster.bootstrap, extra_args=["--config", str(tls_config)]),
            "proxy-tls-refusing": RunningProxy(cluster.bootstrap, extra_args=["--config", str(refusing)]),
        }
        try:
            paths: dict[str, tuple[Address, int | None]] = {
                "direct": (_address(cluster.bootstrap), None),
                "relay": (relay.address, None),
                "proxy": (_address(proxies["proxy"].bootstrap), proxies["proxy"].process.pid),
                "proxy-ip-quota": (_address(proxies["proxy-ip-quota"].bootstrap),
                                   proxies["proxy-ip-quota"].process.pid),
            }
            plain: dict[str, list[tuple[float, float | None]]] = {name: [] for name in paths}
            for _ in range(args.rounds):
                for name, (target, pid) in paths.items():
                    plain[name].append(_measure(target, args.seconds, pid, args.concurrency))
            context = ssl.create_default_context(cafile=str(certificates.ca))
            tls_paths: dict[str, tuple[Address, int | None]] = {
                "direct-tls": (_address(cluster.ssl_bootstrap), None),
                "proxy-tls (handshakes)": (_address(proxies["proxy-tls"].bootstrap),
                                           proxies["proxy-tls"].process.pid),
                "proxy-tls (ip quota refuses first)": (_address(proxies["proxy-tls-refusing"].bootstrap),
                                                       proxies["proxy-tls-refusing"].process.pid),
            }
            secure: dict[str, list[tuple[float, float, float | None]]] = {name: [] for name in tls_paths}
            for _ in range(args.rounds):
                for name, (target, pid) in tls_paths.items():
                    secure[name].append(_tls_measure(target, context, args.seconds, pid, args.concurrency))
        finally:
            relay.close()
            for proxy in proxies.values():
                proxy.stop()

    def col(rows: list[tuple[float, ...]] | list[tuple[float, float | None]]
            | list[tuple[float, float, float | None]], index: int) -> float | None:
        present = [row[index] for row in rows if row[index] is not None]
        return statistics.median(present) if present else None  # type: ignore[type-var]

    direct = col(plain["direct"], 0) or 1.0
    lines = [f"kthrottle connection bench ({os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}), medians "
             f"of {args.rounds} alternating {args.seconds:g} s storms from one address, "
             f"{args.concurrency} in flight",
             "new connections (connect, ApiVersions, answer, close):"]
    for name, rows in plain.items():
        rate = col(rows, 0) or 0.0
        lines.append(f"  {name:<16} {rate:8.0f} conn/s  {rate / direct:5.2f}x direct  "
                     f"proxy CPU {_fmt(col(rows, 1), 'ms/conn')}")
    lines.append("a storm against a TLS listener (handshake, close):")
    for name, rows in secure.items():
        lines.append(f"  {name:<36} {col(rows, 0) or 0.0:8.0f} handshakes/s  {col(rows, 1) or 0.0:8.0f} "
                     f"refused/s  proxy CPU {_fmt(col(rows, 2), 'ms/conn')}")
    print()
    print("\n".join(lines))
    print(f"(bench took {time.monotonic() - began:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
