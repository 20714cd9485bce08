"""A port `kthrottle run` must serve that is already taken ends the run at once, with one line naming
the address and the setting, as a broker does ("Socket server failed to bind to ...: Address already
in use"): no traceback, no supervisor restarting its workers for ever."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from harness.local_kafka import LocalKafka
from proxy.supervisor.workers import BIND_ERROR_EXIT

from .proxies import REPO, free_port_block

#: A run that cannot bind stops within this time (a worker restarted for ever never would).
EXIT_WITHIN_S = 30.0


@contextmanager
def held_port(port: int) -> Iterator[None]:
    """`port` on 127.0.0.1 listened on by this test, as another program would (no SO_REUSEPORT)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen(8)
        yield


def run_until_exit(upstream: str, port: int, *args: str) -> tuple[int, str, float]:
    """`python -m cli run --upstream UPSTREAM --listen 127.0.0.1:PORT ARGS`: its exit code, its stderr
    and how long it ran."""
    began = time.monotonic()
    command = [sys.executable, "-m", "cli", "run", "--upstream", upstream,
               "--listen", f"127.0.0.1:{port}", *args]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, start_new_session=True)
    try:
        _, err = process.communicate(timeout=EXIT_WITHIN_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        _, err = process.communicate()
        pytest.fail(f"kthrottle run still running after {EXIT_WITHIN_S:g} s:\n{err.decode(errors='replace')}")
    return process.returncode, err.decode(errors="replace"), time.monotonic() - began


def check_one_line(code: int, stderr: str, address: str, setting: str) -> None:
    assert code == BIND_ERROR_EXIT, stderr
    assert "Traceback" not in stderr, stderr
    line = f"kthrottle: failed to bind to {address} ({setting}): Address already in use"
    assert stderr.count("failed to bind") == 1 and stderr.rstrip("\n").endswith(line), stderr
    assert "restart" not in stderr, stderr  # the supervisor restarted nothing


@pytest.mark.parametrize("workers", [1, 2])
def test_a_taken_listen_port(kafka_cluster: LocalKafka, workers: int) -> None:
    port = free_port_block(12)
    with held_port(port):
        code, stderr, _ = run_until_exit(kafka_cluster.bootstrap, port, "--workers", str(workers))
    check_one_line(code, stderr, f"127.0.0.1:{port}", "listen")


@pytest.mark.parametrize("workers", [1, 2])
def test_a_taken_metrics_port(kafka_cluster: LocalKafka, workers: int) -> None:
    port = free_port_block(12)
    metrics_port = free_port_block(2)
    with held_port(metrics_port):
        code, stderr, _ = run_until_exit(kafka_cluster.bootstrap, port, "--metrics-port", str(metrics_port),
                                         "--workers", str(workers))
    check_one_line(code, stderr, f"0.0.0.0:{metrics_port}", "metrics_port")


def test_a_taken_broker_port_at_start(kafka_cluster: LocalKafka) -> None:
    """Broker 2's port (listen port + 1 + 2): clients told to use it would reach the other program."""
    port = free_port_block(12)
    with held_port(port + 1 + 2):
        code, stderr, _ = run_until_exit(kafka_cluster.bootstrap, port)
    check_one_line(code, stderr, f"127.0.0.1:{port + 3}", "node_port_base + 2, for broker 2")
    assert not re.search(r"broker 2 is served", stderr)
