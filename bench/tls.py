"""`python -m bench.tls`: what TLS costs through the proxy (issue 12), side by side in one run.

One real 3-broker cluster with PLAINTEXT and SSL listeners (certificates generated at start), and
two proxies in front of it: "proxy" (plaintext both sides) and "proxy-tls" (TLS towards clients
and towards the brokers, `[tls]` + `[upstream_tls]`). Four paths alternate, run by run, with
librdkafka producing and consuming 10 KB records (bench/throughput.py's clients):

    direct       client -> broker PLAINTEXT
    direct-tls   client -> broker SSL
    proxy        client -> proxy -> broker, plaintext
    proxy-tls    client -TLS-> proxy -TLS-> broker SSL

The figures that travel are the ratio proxy-tls / direct-tls and the proxy's CPU per MB on both
proxy paths: terminating TLS means the proxy decrypts every byte from one side and encrypts it
again for the other, which no proxy that reads the Kafka protocol can avoid. The floor of that
is measured here too: OpenSSL's decrypt + encrypt of the same bytes in memory (two TLS sessions
over memory BIOs, the cipher the proxy negotiated), the least any TLS-terminating hop costs.
Figures are printed, never asserted; the bench fails only when something breaks.
"""

from __future__ import annotations

import argparse
import gc
import os
import ssl
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from confluent_kafka.admin import AdminClient

from harness.certificates import TestCertificates
from harness.local_kafka import KAFKA_VERSION, LocalKafka
from tests.integration.proxies import RunningProxy

from . import cpu
from .throughput import (
    MB,
    BenchFailure,
    Comparison,
    Run,
    check_listeners,
    consume,
    create_topic,
    delete_topic,
    produce,
)

PATHS = ("direct", "direct-tls", "proxy", "proxy-tls")


def _tls_client(certificates: TestCertificates) -> dict[str, object]:
    """librdkafka over TLS, verifying the chain and the host name, as a production client would."""
    return {"security.protocol": "SSL", "ssl.ca.location": str(certificates.ca),
            "ssl.endpoint.identification.algorithm": "https"}


def _tls_proxy(cluster: LocalKafka, workdir: Path) -> RunningProxy:
    certificates = cluster.certificates
    assert certificates is not None and cluster.ssl_bootstrap is not None
    config = workdir / "tls.toml"
    config.write_text(f'[tls]\ncertificate = "{certificates.server_cert}"\n'
                      f'key = "{certificates.server_key}"\n\n[upstream_tls]\nca = "{certificates.ca}"\n')
    return RunningProxy(cluster.ssl_bootstrap, extra_args=["--config", str(config)])


class TlsBench:
    def __init__(self, cluster: LocalKafka, proxies: dict[str, RunningProxy], records: int,
                 consume_records: int) -> None:
        certificates = cluster.certificates
        assert certificates is not None and cluster.ssl_bootstrap is not None
        self.cluster = cluster
        self.proxies = proxies
        self.records = records
        self.consume_records = consume_records
        self.admin = AdminClient({"bootstrap.servers": cluster.bootstrap})
        tls = _tls_client(certificates)
        self.paths: dict[str, tuple[str, dict[str, object]]] = {
            "direct": (cluster.bootstrap, {}),
            "direct-tls": (cluster.ssl_bootstrap, tls),
            "proxy": (proxies["proxy"].bootstrap, {}),
            "proxy-tls": (proxies["proxy-tls"].bootstrap, tls),
        }
        self.tag = uuid.uuid4().hex[:8]

    def _timed(self, path: str, transfer: object) -> Run:
        for name, proxy in self.proxies.items():
            if not proxy.alive():
                raise BenchFailure(f"the {name} proxy exited during the bench:\n{proxy.log()[-4000:]}")
        proxy = self.proxies.get(path)
        window = cpu.CpuWindow.open(proxy.process.pid if proxy is not None else os.getpid())
        records, payload, seconds = transfer()  # type: ignore[operator]
        usage = window.close()
        proxy_cpu = usage.process_cpu_s if proxy is not None else None
        return Run(path, records, payload, seconds, proxy_cpu, None, usage.busy, usage.iowait)

    def _alternate(self, rounds: int, one: object) -> list[Run]:
        runs = []
        for round_no in range(rounds):
            for path in PATHS:
                run: Run = one(path, round_no)  # type: ignore[operator]
                note = (f", proxy CPU {100 * run.proxy_cpu_s / run.seconds:3.0f}% of a core"
                        if run.proxy_cpu_s is not None else "")
                print(f"  round {round_no + 1} {path:10} {run.mb_per_s:7.1f} MB/s {run.seconds:6.2f} s{note}",
                      flush=True)
                runs.append(run)
        return runs

    def produce_rounds(self, rounds: int) -> Comparison:
        for path in PATHS:  # unmeasured: connect every path to every broker, warm the brokers
            bootstrap, config = self.paths[path]
            topic = f"bench-tls-warmup-{path}-{self.tag}"
            create_topic(self.admin, topic)
            produce(path, bootstrap, topic, max(1, self.records // 4), config)
            delete_topic(self.admin, topic)

        def one(path: str, round_no: int) -> Run:
            bootstrap, config = self.paths[path]
            topic = f"bench-tls-produce-{path}-{round_no}-{self.tag}"
            create_topic(self.admin, topic)
            run = self._timed(path, lambda: produce(path, bootstrap, topic, self.records, config))
            delete_topic(self.admin, topic)
            return run

        print(f"produce: {self.records} x 10 KB records per run, acks=1, fresh topic per run", flush=True)
        return Comparison("produce", self._alternate(rounds, one))

    def consume_rounds(self, rounds: int) -> Comparison:
        topic = f"bench-tls-consume-{self.tag}"
        create_topic(self.admin, topic)
        produce("direct", self.cluster.bootstrap, topic, self.consume_records)
        for path in PATHS:  # unmeasured: the page cache and every path warm
            bootstrap, config = self.paths[path]
            consume(path, bootstrap, topic, self.consume_records, config)
        print(f"consume: the same {self.consume_records} records each run", flush=True)

        def one(path: str, _round: int) -> Run:
            bootstrap, config = self.paths[path]
            return self._timed(path, lambda: consume(path, bootstrap, topic, self.consume_records, config))

        runs = self._alternate(rounds, one)
        delete_topic(self.admin, topic)
        return Comparison("consume", runs)


# -- the floor: OpenSSL's decrypt + encrypt of every byte ----------------------------------------


def _session_pair(certificates: TestCertificates) -> tuple[ssl.SSLObject, ssl.MemoryBIO, ssl.SSLObject,
                                                             ssl.MemoryBIO]:
    """A client and a server TLS session joined by memory BIOs, handshaken: (client, its outgoing
    BIO, server, its incoming BIO)."""
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_context.load_cert_chain(certificates.server_cert, certificates.server_key)
    client_context = ssl.create_default_context(cafile=str(certificates.ca))
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    client = client_context.wrap_bio(c_in, c_out, server_hostname="127.0.0.1")
    server = server_context.wrap_bio(s_in, s_out, server_side=True)
    done = {id(client): False, id(server): False}
    for _ in range(20):
        for side in (client, server):
            if not done[id(side)]:
                try:
                    side.do_handshake()
                    done[id(side)] = True
                except ssl.SSLWantReadError:
                    pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if all(done.values()):
            return client, c_out, server, s_in
    raise BenchFailure("the in-memory TLS handshake did not finish")


def crypto_floor(certificates: TestCertificates, total: int = 600 * MB) -> tuple[str, float]:
    """(cipher, CPU ms per MB) for encrypting on one session and decrypting on another in memory:
    what one TLS-terminating hop must spend per byte (it decrypts from one side and encrypts for
    the other), with no sockets, no Kafka and no Python per byte beyond 64 KB writes."""
    client, c_out, server, s_in = _session_pair(certificates)
    chunk = os.urandom(64 * 1024)
    sent = 0
    started = time.process_time()
    while sent < total:
        client.write(chunk)
        s_in.write(c_out.read())
        while True:
            try:
                server.read(1 << 20)
            except ssl.SSLWantReadError:
                break
        sent += len(chunk)
    seconds = time.process_time() - started
    cipher = server.cipher()
    return (cipher[0] if cipher else "?"), 1000 * seconds / (sent / MB)


# -- the summary ----------------------------------------------------------------------------------


def _lines(comp: Comparison) -> list[str]:
    lines = []
    for path in PATHS:
        label = f"{comp.name} 10KB" if path == PATHS[0] else ""
        line = f"{label:13} {path:10} {comp.median_mb_per_s(path):7.1f} MB/s"
        if path == "proxy":
            ratios = comp.round_ratios("proxy")
            line += f"   vs direct {comp.ratio('proxy'):.2f} (per round {ratios[0]:.2f}..{ratios[-1]:.2f})"
        if path == "proxy-tls":
            ratios = comp.round_ratios("proxy-tls", "direct-tls")
            line += (f"   vs direct-tls {comp.ratio('proxy-tls', 'direct-tls'):.2f} "
                     f"(per round {ratios[0]:.2f}..{ratios[-1]:.2f})")
        if path == "direct-tls":
            line += f"   vs direct {comp.ratio('direct-tls'):.2f}"
        cost = comp.proxy_cpu_ms_per_mb(path)
        if cost is not None:
            line += f"   proxy CPU {cost:.2f} ms/MB"
        machine = comp.machine_ms_per_mb(path)
        if machine is not None:
            line += f"   machine {machine:.2f} ms/MB"
        lines.append(line)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tls", description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=20_000, help="10 KB records per produce run")
    parser.add_argument("--consume-records", type=int, default=40_000, help="10 KB records per consume run")
    parser.add_argument("--rounds", type=int, default=3, help="runs per path, alternating")
    args = parser.parse_args(argv)
    began = time.monotonic()
    print(f"starting 3 Kafka {KAFKA_VERSION} brokers with SSL listeners...", flush=True)
    with (LocalKafka(brokers=3, tls=True) as cluster,
          tempfile.TemporaryDirectory(prefix="kthrottle-bench-tls-") as tmp):
        certificates = cluster.certificates
        assert certificates is not None
        cipher, floor_ms = crypto_floor(certificates)
        print(f"OpenSSL floor: {cipher}, encrypt + decrypt in memory {floor_ms:.2f} ms per MB", flush=True)
        proxies: dict[str, RunningProxy] = {}
        try:
            proxies["proxy"] = RunningProxy(cluster.bootstrap)
            proxies["proxy-tls"] = _tls_proxy(cluster, Path(tmp))
            for proxy in proxies.values():
                check_listeners(proxy, cluster.node_ids)
            bench = TlsBench(cluster, proxies, args.records, args.consume_records)
            produced = bench.produce_rounds(args.rounds)
            consumed = bench.consume_rounds(args.rounds)
        finally:
            for proxy in proxies.values():
                proxy.stop()
            gc.collect()
    lines = [f"kthrottle TLS bench ({os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}), medians of "
             f"{args.rounds} alternating rounds; proxy CPU per MB moved (terminating TLS decrypts and "
             f"re-encrypts each byte once: OpenSSL's own floor for that is {floor_ms:.2f} ms/MB, {cipher})",
             *_lines(produced), *_lines(consumed)]
    extra = [c.proxy_cpu_ms_per_mb("proxy-tls") - (c.proxy_cpu_ms_per_mb("proxy") or 0.0)
             for c in (produced, consumed) if c.proxy_cpu_ms_per_mb("proxy-tls") is not None]
    if extra:
        lines.append(f"TLS adds {statistics.mean(extra):.2f} ms of proxy CPU per MB on average "
                     f"(floor {floor_ms:.2f})")
    print()
    print("\n".join(lines))
    print(f"(bench took {time.monotonic() - began:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
