"""Client addresses behind a load balancer and over several proxies (issue 20), against the real cluster.

- A real HAProxy (tests/integration/haproxy.py) in front of the proxy, sending PROXY headers v2 and v1:
  the `ip` quota applies to the address HAProxy names, not to HAProxy's own; a balancer the proxy does
  not trust, and a client that bypasses the balancer, are closed with a log line saying why.
- One `ip` quota over a static fleet of two proxies, and over `--workers 2`: an address storming both
  is held to the quota in total, the IP buckets travelling in the fleet's usage exchange.

The bounds are the issue's (see test_client_addresses.py for how a storm is counted).
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient

from harness.local_kafka import LocalKafka
from harness.ports import free_udp_port
from protocol.proxy_header import V2_SIGNATURE, encode_v2

from .clients import api_versions_v0, assert_exact, wait_until
from .haproxy import PROXY_HOST, RunningHaproxy, same_ports
from .quota_runs import report
from .storms import Outcome, StormResult, burst, storm, storm_async
from .test_client_addresses import (
    RATE,
    RUN_S,
    THROTTLED_IP,
    AddressProxy,
    assert_rates,
    ip_quota,
    kafka_round_trip,
    make_topic,
    rate_held,
    summed,
    timeline,
)

PROXY_PROTOCOL = '[proxy]\nproxy_protocol = "v1,v2"\nproxy_protocol_trusted = ["127.0.0.1"]\n\n'
REFUSED = "kthrottle_connections_refused_total"


def refused_proxy_header(proxy: AddressProxy) -> float:
    return proxy.metric(REFUSED, reason="proxy_header")


def closed_after(address: tuple[str, int], data: bytes, wait: float = 10.0) -> float:
    """Send `data` and wait for the peer to close: how many seconds that took (`wait` if it did not)."""
    started = time.monotonic()
    with socket.create_connection(address, timeout=wait) as sock:
        sock.sendall(data)
        try:
            while sock.recv(4096):
                pass
        except ConnectionResetError:
            pass
        except TimeoutError:
            return wait
    return time.monotonic() - started


# -- 4. HAProxy sends the client's address ---------------------------------------------------------------


def test_haproxy_sends_the_real_client_address(kafka_cluster: LocalKafka, tmp_path: Path) -> None:
    """proxy_protocol "v1,v2", trusting 127.0.0.1 (where HAProxy connects from), ip 127.0.0.2 = 20/s:
    through HAProxy (send-proxy-v2) 127.0.0.2 is throttled and 127.0.0.3 is not, while a producer and a
    consumer that follow the advertised addresses through HAProxy see their exact records; the same
    through send-proxy (v1); an untrusted HAProxy (connecting from 127.0.0.5) and a client without a
    header are closed, with the reason in the log."""
    topic = make_topic(kafka_cluster.bootstrap, "haproxy")
    records = 1200
    seconds = 10.0
    config = PROXY_PROTOCOL + ip_quota("127.0.0.2", RATE)
    with AddressProxy(kafka_cluster.bootstrap, tmp_path, config,
                      extra_args=["--advertised-host", PROXY_HOST]) as proxy, \
            RunningHaproxy(same_ports(proxy.port, kafka_cluster.node_ids), "send-proxy-v2",
                           bind_host=PROXY_HOST) as lb:
        target = (PROXY_HOST, proxy.port)
        bootstrap = f"{PROXY_HOST}:{proxy.port}"

        async def storms() -> list[StormResult]:
            return list(await asyncio.gather(storm_async(target, "127.0.0.2", seconds),
                                             storm_async(target, "127.0.0.3", seconds, concurrency=8)))

        with ThreadPoolExecutor(2) as pool:
            storming = pool.submit(asyncio.run, storms())
            consumed = pool.submit(kafka_round_trip, bootstrap, topic, records)
            throttled, free = storming.result()
            got = consumed.result()
        brokers = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=15).brokers
        report(f"HAProxy send-proxy-v2, {seconds:.0f} s: 127.0.0.2 (20/s) {throttled.summary()}, per 1 s "
               f"{timeline(throttled, 1.0)}; 127.0.0.3 (no quota) {free.summary()}")
        assert throttled.closed > 0, f"127.0.0.2 through HAProxy was not throttled: {throttled.summary()}"
        # Kafka's window lets a fresh address open ~10 s worth at once: at most (10 + seconds) x rate
        assert 0 < throttled.served <= 1.1 * RATE * (10 + seconds), throttled.summary()
        assert free.served == free.total > 0, free.details().most_common(3)
        # From 127.0.0.2's first throttle on (its window's burst spent), it gets less than half what the
        # unthrottled address gets in the same seconds. Not over the whole storm: on a loaded machine
        # (CI's, 378 connections for 127.0.0.3 in 10 s) the burst alone is half the free address's count.
        first_throttle = min(a.finished for a in throttled.attempts if a.outcome is Outcome.CLOSED)
        after = {name: sum(1 for t in result.served_times() if first_throttle < t <= seconds)
                 for name, result in (("127.0.0.2", throttled), ("127.0.0.3", free))}
        assert after["127.0.0.2"] < 0.5 * after["127.0.0.3"], \
            f"127.0.0.2 got about as much as an unthrottled address after {first_throttle:.1f} s: {after}"
        assert_exact(got, records)
        assert {(str(b.host), b.port) for b in brokers.values()} == {
            (PROXY_HOST, proxy.node_port(node)) for node in kafka_cluster.node_ids}
        assert proxy.metric("kthrottle_ip_connection_creation_limit", ip="127.0.0.2") == RATE
        assert refused_proxy_header(proxy) == 0, proxy.log()[-3000:]
        assert lb.alive()

        # v1: the same address throttled through a `send-proxy` HAProxy (the bucket already full)
        with RunningHaproxy(("127.0.0.1", proxy.port), "send-proxy", bind_host=PROXY_HOST) as v1:
            short = 5.0
            over = storm(v1.address, "127.0.0.2", short)
            other = storm(v1.address, "127.0.0.3", 2.0, concurrency=8)
        report(f"HAProxy send-proxy (v1), {short:.0f} s: 127.0.0.2 {over.summary()}, per 1 s "
               f"{timeline(over, 1.0)}; 127.0.0.3 {other.summary()}")
        assert over.closed > 0 and over.served > 0, over.summary()
        # whatever phase of its window the bucket is in: at most one window (~12 s) paid ahead
        assert over.served <= 1.1 * RATE * (12 + short), over.summary()
        assert other.served == other.total > 0, other.details().most_common(3)
        samples = proxy.metrics()
        assert summed(samples, "kthrottle_connections_throttled_total", reason=THROTTLED_IP) >= \
            throttled.closed + over.closed

        # An HAProxy connecting from 127.0.0.5, which is not in proxy_protocol_trusted.
        before = refused_proxy_header(proxy)
        with RunningHaproxy(("127.0.0.1", proxy.port), "send-proxy-v2", bind_host=PROXY_HOST,
                            source="127.0.0.5") as untrusted:
            attempts = burst(untrusted.address, "127.0.0.3", 20, timeout=15)
        outcomes = {a.outcome for a in attempts}
        assert outcomes == {Outcome.CLOSED}, [(a.outcome, a.detail) for a in attempts][:5]
        assert refused_proxy_header(proxy) >= before + 20
        log = proxy.log()
        untrusted_lines = [line for line in log.splitlines() if "127.0.0.5" in line]
        assert untrusted_lines and all("proxy_protocol_trusted" in line for line in untrusted_lines), \
            untrusted_lines[:3]

        # A client that bypasses the balancer: no header, closed.
        before = refused_proxy_header(proxy)
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock, \
                pytest.raises(ConnectionError):
            api_versions_v0(sock, 7)
        proxy.wait_for_log("no PROXY header", 5)
        # Headers no balancer sends: each closed at once, with what was wrong in the log.
        too_long = V2_SIGNATURE + bytes([0x21, 0x11]) + (65535).to_bytes(2, "big")  # and no body
        bad_v1 = b"PROXY TCP4 127.0.0.256 127.0.0.1 40000 9092\r\n"
        for data, logged in ((too_long, "65551 bytes"), (bad_v1, "127.0.0.256")):
            took = closed_after(("127.0.0.1", proxy.port), data)
            assert took < 2.0, f"{data!r}: closed only after {took:.1f} s"
            proxy.wait_for_log(logged, 5)
        wait_until(lambda: refused_proxy_header(proxy) == before + 3, 5, "the 3 refusals counted")
        # ... while a header from a trusted peer, then the request, is answered.
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
            sock.sendall(encode_v2(("127.0.0.3", 40000), ("127.0.0.1", proxy.port)))
            assert api_versions_v0(sock, 8) == 8
        log = proxy.log()
        assert proxy.alive() and "Traceback" not in log
        closes = [line.split(": ", 2)[-1] for line in log.splitlines()
                  if "closed a connection from 127.0.0.1" in line]
        report(f"untrusted HAProxy (127.0.0.5): 20 of 20 closed; log: {untrusted_lines[0][-150:]}; "
               f"bad headers direct: {closes}")


# -- 5. one ip quota over a fleet of proxies, and over workers ------------------------------------------


def fleet_config(udp_port: int, peer: int, secret: Path, quotas: str) -> str:
    return (f'[proxy]\n\n[fleet]\nname = "ip-fleet"\nlisten = "127.0.0.1:{udp_port}"\n'
            f'secret_file = "{secret}"\npeers = ["127.0.0.1:{peer}"]\n\n{quotas}')


@pytest.mark.cpu_sensitive  # the storms must reach the proxies at full speed
def test_one_ip_quota_over_a_fleet_and_workers(kafka_cluster: LocalKafka, tmp_path: Path) -> None:
    """Two proxies in a static fleet, both with ip 127.0.0.9 = 20/s: one address storming both at once is
    served 20/s in total over RUN_S (0.85-1.10x); then one proxy with --workers 2, one storm: the same."""
    quotas = ip_quota("127.0.0.9", RATE)
    secret = tmp_path / "fleet.secret"
    secret.write_text(os.urandom(32).hex() + "\n")
    ports = [free_udp_port(), free_udp_port()]
    configs = [fleet_config(ports[i], ports[1 - i], secret, quotas) for i in (0, 1)]
    with AddressProxy(kafka_cluster.bootstrap, tmp_path, configs[0]) as one, \
            AddressProxy(kafka_cluster.bootstrap, tmp_path, configs[1]) as two:
        for member in (one, two):
            wait_until(lambda m=member: m.metric("kthrottle_fleet_members") == 2, 15, "2 members")

        async def storms() -> list[StormResult]:
            return list(await asyncio.gather(storm_async(one.address, "127.0.0.9", RUN_S),
                                             storm_async(two.address, "127.0.0.9", RUN_S)))

        fleet = asyncio.run(storms())
        limits = [m.metric("kthrottle_ip_connection_creation_limit", ip="127.0.0.9") for m in (one, two)]
        throttled = [summed(m.metrics(), "kthrottle_connections_throttled_total", reason=THROTTLED_IP)
                     for m in (one, two)]
        assert one.alive() and two.alive()
    measured = {"fleet of 2, 127.0.0.9 storming both": rate_held(
        "fleet of 2 proxies, ip 127.0.0.9 = 20/s, one storm on each", fleet)}
    assert limits == [RATE, RATE]
    assert all(t > 0 for t in throttled), throttled
    assert all(r.served > 0 for r in fleet), [r.summary() for r in fleet]

    with AddressProxy(kafka_cluster.bootstrap, tmp_path, "[proxy]\n\n" + quotas, workers=2) as workers:
        for worker in (0, 1):
            wait_until(lambda w=worker: workers.metric("kthrottle_fleet_members", w) == 2, 15, "2 workers")
        alone = storm(workers.address, "127.0.0.9", RUN_S)
        throttled = [summed(workers.metrics(w), "kthrottle_connections_throttled_total", reason=THROTTLED_IP)
                     for w in (0, 1)]
        peer_waits = [summed(workers.metrics(w), "kthrottle_connections_peer_waits_total") for w in (0, 1)]
        assert workers.alive()
    measured["--workers 2, 127.0.0.9 storming"] = rate_held("--workers 2, ip 127.0.0.9 = 20/s, one storm",
                                                            [alone])
    report(f"--workers 2: throttled by worker {throttled}, waits for the peer's report {peer_waits}")
    assert all(t > 0 for t in throttled), f"a worker took none of the storm's connections: {throttled}"
    assert_rates(measured, low=0.85, high=1.10)
