"""`kthrottle_upstream_up` and `/ready` say whether a Kafka broker answers, not only whether a port
accepts connections: the probe is an ApiVersions round trip, over TLS too, before SASL too."""

from __future__ import annotations

import re
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from harness.local_kafka import LocalKafka
from proxy.upstream.health import PROBE_TIMEOUT_S

from .proxies import RunningProxy, free_port_block


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@contextmanager
def silent_upstream() -> Iterator[int]:
    """A loopback port that accepts every connection and never sends a byte (a hung broker, a
    load balancer with nothing behind it)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                held.append(listener.accept()[0])
            except OSError:  # closed: the test is over
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield int(listener.getsockname()[1])
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        thread.join(5)
        for sock in held:
            sock.close()


def test_an_upstream_that_accepts_and_never_answers_is_down_with_the_reason() -> None:
    metrics_port = free_port_block(1)
    reason = f"no answer to ApiVersions within {PROBE_TIMEOUT_S:g} s"
    with silent_upstream() as port, RunningProxy(f"127.0.0.1:{port}",
                                                 extra_args=["--metrics-port", str(metrics_port)]) as running:
        status, text = http_get(metrics_port, "/ready")
        assert (status, text) == (503, f"127.0.0.1:{port}: {reason}\n")
        metrics = http_get(metrics_port, "/metrics")[1]
        assert re.search(r"^kthrottle_upstream_up 0\.0$", metrics, re.M), metrics
        log = running.log()
    assert re.search(r"ERROR kthrottle\.upstream: upstream unreachable, .*: "
                     + re.escape(f"127.0.0.1:{port}: {reason}") + "$", log, re.M), log
    assert "upstream reachable" not in log
    assert not re.search(r":\s*\)", log), log  # no reason left empty, as "skipped (127.0.0.1:9092: )" was


def _ready_proxy(upstream: str, workdir: Path, tables: str = "") -> tuple[int, str, float]:
    """/ready's answer and kthrottle_upstream_up of a proxy in front of `upstream`."""
    config = workdir / "kthrottle.toml"
    config.write_text(f"[proxy]\n\n{tables}\n")
    metrics_port = free_port_block(1)
    with RunningProxy(upstream, extra_args=["--config", str(config), "--metrics-port", str(metrics_port)]):
        status, text = http_get(metrics_port, "/ready")
        metrics = http_get(metrics_port, "/metrics")[1]
    up = re.search(r"^kthrottle_upstream_up (\S+)$", metrics, re.M)
    assert up is not None, metrics
    return status, text, float(up.group(1))


def test_a_tls_upstream_answers_the_probe_over_tls(kafka_cluster: LocalKafka, tmp_path: Path) -> None:
    assert kafka_cluster.ssl_bootstrap and kafka_cluster.certificates is not None
    upstream = kafka_cluster.ssl_bootstrap
    first = upstream.split(",")[0]
    status, text, up = _ready_proxy(upstream, tmp_path,
                                    f'[upstream_tls]\nca = "{kafka_cluster.certificates.ca}"\n')
    assert (status, up) == (200, 1.0) and f"{first} answers ApiVersions" in text, text


def test_a_sasl_upstream_answers_the_probe_before_authentication(kafka_cluster: LocalKafka,
                                                                 tmp_path: Path) -> None:
    assert kafka_cluster.sasl_bootstrap
    status, text, up = _ready_proxy(kafka_cluster.sasl_bootstrap, tmp_path)
    assert (status, up) == (200, 1.0) and "answers ApiVersions" in text, text
