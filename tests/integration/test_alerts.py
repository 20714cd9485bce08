"""deploy/prometheus/alerts.yml in a real Prometheus, scraping two real proxies in front of the cluster.

Two `kthrottle run` processes form a static fleet; proxy A fronts the cluster directly, with quotas
and usage events, and carries real client traffic; proxy B reaches the cluster only through a TCP
relay (tcp_relay.py) the test can take away. A real Prometheus (Debian's, from `make tools`)
scrapes both every second and evaluates the rules. The test cuts B's upstream and waits for
KthrottleUpstreamDown to fire for B's instance and never for A's; then every kthrottle_ name the
rules and the Grafana dashboards use must be one the two proxies really exported.

How the proxy decides its upstream is down (proxy upstream health): every 5 s it opens a TCP
connection to the brokers it knows (their own addresses, learned from Metadata: at start-up and
from client traffic), then to its --upstream list, and reports 0 only when none accepts. So B
must know no broker's own address: its relay is cut (accepting and closing at once) while B starts,
so B's start-up discovery learns nothing, and no client ever sends B a Metadata request. The cut
that counts closes the relay's listener (connections refused): a relay or a load balancer that
still accepts and then closes can pass the TCP probe.
"""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from harness.local_kafka import LocalKafka
from harness.ports import free_udp_port

from .clients import topic_name
from .proxies import REPO, RunningProxy, free_port_block
from .tcp_relay import TcpRelay

RULES = REPO / "deploy" / "prometheus" / "alerts.yml"
DASHBOARDS = REPO / "deploy" / "grafana" / "dashboards"
INSTALL_HINT = ("prometheus not found: run `make tools` (it installs Debian's prometheus package, "
                "/usr/bin/prometheus and /usr/bin/promtool)")
UPSTREAM_DOWN = "KthrottleUpstreamDown"

#: A PromQL identifier (metric names may hold colons: recording rules' names do).
IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
#: String literals: label values and regexes, never metric names to check.
STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')

CLIENT = "alerts"
#: Client "alerts" gets every quota type a dashboard panel charts, small enough that ~30 KB throttle
#: it; every user gets a producer-id quota (the idempotent producer's id is charged to it); every
#: address an ip quota it never reaches (so the per-ip series exist).
QUOTAS = f"""\
[[quota]]
client_id = "{CLIENT}"
producer_byte_rate = 1000
consumer_byte_rate = 1000
request_percentage = 50.0

[[quota]]
user = "<default>"
producer_ids_rate = 1

[[quota]]
ip = "<default>"
connection_creation_rate = 1000000

[capacity]
produce_byte_rate = 1000000000000
fetch_byte_rate = 1000000000000
request_percentage = 1000000.0
adaptive = true
"""


# -- a real Prometheus ------------------------------------------------------------------------------


class PrometheusServer:
    """`prometheus` on a free loopback port, with its data and log in `workdir`."""

    def __init__(self, workdir: Path, config: Path) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail(INSTALL_HINT, pytrace=False)
        self.port = free_port_block(1)
        self.log_path = workdir / "prometheus.log"
        # Open for the server's whole life (closed in stop()), so no context manager.
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 30
        while not self._ready():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"prometheus did not start (exit {self.process.returncode}):\n"
                                     f"{self.log()[-3000:]}")
            time.sleep(0.1)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as answer:
                return bool(answer.status == 200)
        except OSError:
            return False

    def api(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}{query}"
        with urllib.request.urlopen(url, timeout=10) as answer:
            body = json.loads(answer.read())
        assert body["status"] == "success", body
        return body["data"]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=15)
        self._log.close()


def _rules_for_the_test(workdir: Path) -> Path:
    """alerts.yml as it is, except KthrottleUpstreamDown's `for:` shortened from 1m to 2s, so the
    test waits seconds, not a minute (a copy in `workdir`; the expression is untouched)."""
    text = RULES.read_text()
    block = re.search(rf"- alert: {UPSTREAM_DOWN}\n(?:(?!\s*- (?:alert|record):).*\n)*", text)
    assert block, f"{UPSTREAM_DOWN} not in {RULES}"
    shortened, count = re.subn(r"(\n\s+for:\s*)\S+", r"\g<1>2s", block.group(0), count=1)
    assert count == 1, f"{UPSTREAM_DOWN} has no for: in {RULES}"
    copy = workdir / "alerts.yml"
    copy.write_text(text.replace(block.group(0), shortened))
    return copy


def _prometheus_config(workdir: Path, rules: Path, targets: list[str]) -> Path:
    config = workdir / "prometheus.yml"
    config.write_text(f"""\
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
rule_files:
  - {rules}
scrape_configs:
  - job_name: kthrottle
    static_configs:
      - targets: {json.dumps(targets)}
""")
    return config


# -- the proxies ------------------------------------------------------------------------------------


def _start_proxy(upstream: str, config: Path, text: str) -> tuple[RunningProxy, int]:
    config.write_text(text)
    metrics_port = free_port_block(1)
    proxy = RunningProxy(upstream, extra_args=["--config", str(config), "--metrics-port", str(metrics_port)])
    return proxy, metrics_port


def _produce(bootstrap: str, topic: str, partition: int, count: int, size: int) -> None:
    """`count` records of `size` incompressible bytes in one batch (one Produce request)."""
    producer = Producer({"bootstrap.servers": bootstrap, "client.id": CLIENT, "enable.idempotence": True,
                         "linger.ms": 500, "batch.size": 1_000_000, "compression.type": "none"})
    errors: list[str] = []

    def report(err: KafkaError | None, _msg: object) -> None:
        if err is not None:
            errors.append(str(err))

    for i in range(count):
        producer.produce(topic, f"{i:08d}".encode() + secrets.token_bytes(size - 8), partition=partition,
                         on_delivery=report)
    left = producer.flush(60)
    assert left == 0 and not errors, f"{left} records still queued, errors {errors[:3]}"


def _consume(bootstrap: str, topic: str, partition: int, expected: int) -> int:
    consumer = Consumer({"bootstrap.servers": bootstrap, "client.id": CLIENT, "group.id": f"{CLIENT}-group",
                         "enable.auto.commit": False})
    consumer.assign([TopicPartition(topic, partition, OFFSET_BEGINNING)])
    got = 0
    deadline = time.monotonic() + 30
    try:
        while got < expected and time.monotonic() < deadline:
            for message in consumer.consume(100, timeout=0.5):
                assert not message.error(), message.error()
                got += 1
    finally:
        consumer.close()
    return got


def _refuse_one(port: int) -> None:
    """Two connections from 127.0.0.1 to a proxy with max_connections_per_ip = 1: the second is closed."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as first:
        time.sleep(0.3)  # the proxy has counted the first
        with socket.create_connection(("127.0.0.1", port), timeout=5) as second:
            second.settimeout(5)
            assert second.recv(1) == b"", "the connection over max_connections_per_ip was not closed"
        first.close()


# -- names in PromQL --------------------------------------------------------------------------------


def _names(promql: str) -> set[str]:
    """Every kthrottle_ series name a PromQL expression selects (string literals left out), and
    recorded names (level:metric:operations, with colons) too."""
    return {name for name in IDENTIFIER.findall(STRING.sub('""', promql))
            if name.startswith("kthrottle_") or ":kthrottle_" in name}


def _dashboard_queries() -> list[tuple[str, str]]:
    """(dashboard file, PromQL) for every `expr` and query variable anywhere in each dashboard."""
    found: list[tuple[str, str]] = []

    def walk(node: object, where: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("expr", "query", "definition") and isinstance(value, str):
                    found.append((where, value))
                else:
                    walk(value, where)
        elif isinstance(node, list):
            for item in node:
                walk(item, where)

    dashboards = sorted(DASHBOARDS.glob("*.json"))
    assert dashboards, f"no dashboard in {DASHBOARDS}"
    for path in dashboards:
        walk(json.loads(path.read_text()), path.name)
    return found


def _wait(what: str, timeout: float, check: Any) -> Any:
    """Poll `check()` until it returns something truthy; fail naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g} s")
        time.sleep(0.5)


# -- the test ---------------------------------------------------------------------------------------


@pytest.fixture
def relay(kafka_cluster: LocalKafka) -> Iterator[TcpRelay]:
    host, port = kafka_cluster.bootstrap.split(",")[0].rsplit(":", 1)
    relay = TcpRelay((host, int(port)))
    try:
        yield relay
    finally:
        relay.close()


def test_prometheus_fires_upstream_down_for_the_cut_proxy_and_knows_every_name(
        kafka_cluster: LocalKafka, relay: TcpRelay, tmp_path: Path) -> None:
    secret = tmp_path / "fleet.secret"
    secret.write_text(secrets.token_hex(32))
    udp_a, udp_b = free_udp_port(), free_udp_port()
    fleet_name = f"alerts-{secrets.token_hex(4)}"

    def fleet(udp_port: int) -> str:
        return (f'[fleet]\nname = "{fleet_name}"\nlisten = "127.0.0.1:{udp_port}"\nsecret_file = "{secret}"\n'
                f'peers = ["127.0.0.1:{udp_a}", "127.0.0.1:{udp_b}"]\n\n')

    usage_topic = topic_name("alerts-usage")
    started: list[RunningProxy] = []
    prometheus: PrometheusServer | None = None
    try:
        # B first, its relay cut: its start-up discovery learns nothing, so it knows only the relay.
        relay.cut()
        host, port = relay.address
        proxy_b, metrics_b = _start_proxy(f"{host}:{port}", tmp_path / "b.toml",
                                          f"[proxy]\nmax_connections_per_ip = 1\n\n{fleet(udp_b)}")
        started.append(proxy_b)
        # (Its first probe may pass, the relay accepting before it closes, or see the reset; the
        # discovery that follows a pass fails. Either way no broker address is learned.)
        assert not re.search(r"broker \d+ is served on", proxy_b.log()), (
            f"B learned a broker's own address, so cutting its relay cannot take its upstream away:\n"
            f"{proxy_b.log()[-3000:]}")
        relay.restore()
        proxy_a, metrics_a = _start_proxy(
            kafka_cluster.bootstrap, tmp_path / "a.toml",
            f"{fleet(udp_a)}[usage]\ninterval_ms = 1000\ntopic = \"{usage_topic}\"\n\n{QUOTAS}")
        started.append(proxy_a)
        instance_a, instance_b = f"127.0.0.1:{metrics_a}", f"127.0.0.1:{metrics_b}"

        rules = _rules_for_the_test(tmp_path)
        prometheus = PrometheusServer(tmp_path, _prometheus_config(tmp_path, rules, [instance_a, instance_b]))

        # Traffic through A, so the per-entity families have series: ~30 KB over a 1000 B/s quota
        # throttles "alerts" (a small batch first, on its own partition, which the consumer reads).
        topic = topic_name("alerts")
        admin = AdminClient({"bootstrap.servers": proxy_a.bootstrap, "client.id": f"{CLIENT}-admin"})
        admin.create_topics([NewTopic(topic, 2, 1)])[topic].result(30)
        _produce(proxy_a.bootstrap, topic, partition=0, count=5, size=1000)
        _produce(proxy_a.bootstrap, topic, partition=1, count=30, size=1000)
        assert _consume(proxy_a.bootstrap, topic, partition=0, expected=5) == 5
        _refuse_one(proxy_b.port)  # raw sockets: B serves no Kafka client, so learns no broker

        # Prometheus loaded every rule of alerts.yml, and evaluates them without error.
        groups = prometheus.api("rules")["groups"]
        loaded = {rule["name"]: rule for group in groups for rule in group["rules"]}
        in_file = set(re.findall(r"^\s*- (?:alert|record):\s*(\S+)\s*$", RULES.read_text(), re.MULTILINE))
        assert set(loaded) == in_file, f"loaded {sorted(loaded)}, the file has {sorted(in_file)}"

        # Both proxies are up for Prometheus before the cut.
        def upstream_up() -> dict[str, float]:
            result = prometheus.api("query", query="kthrottle_upstream_up")["result"]
            return {series["metric"]["instance"]: float(series["value"][1]) for series in result}

        def upstream_down_alerts() -> list[dict[str, Any]]:
            return [alert for alert in prometheus.api("alerts")["alerts"]
                    if alert["labels"]["alertname"] == UPSTREAM_DOWN]

        _wait("kthrottle_upstream_up = 1 for both proxies, and no upstream-down alert", 30,
              lambda: upstream_up() == {instance_a: 1.0, instance_b: 1.0} and not upstream_down_alerts())

        # -- the cut: B's relay refuses connections from now on --------------------------------------
        cut_at = time.monotonic()
        relay.cut()
        relay.close()

        def firing_for_b() -> list[dict[str, Any]]:
            found = upstream_down_alerts()
            others = [alert for alert in found if alert["labels"].get("instance") != instance_b]
            assert not others, f"{UPSTREAM_DOWN} for a proxy whose upstream is up: {others}"
            return [alert for alert in found if alert["state"] == "firing"]

        firing = _wait(f"{UPSTREAM_DOWN} firing for {instance_b}", 60, firing_for_b)
        took = time.monotonic() - cut_at
        assert [alert["labels"]["instance"] for alert in firing] == [instance_b]
        assert firing[0]["labels"]["severity"] == "critical"
        assert instance_b in firing[0]["annotations"]["summary"], firing[0]["annotations"]
        assert upstream_up() == {instance_a: 1.0, instance_b: 0.0}
        assert "upstream unreachable" in proxy_b.log() and "upstream unreachable" not in proxy_a.log()
        print(f"{UPSTREAM_DOWN} firing for the cut proxy {took:.1f} s after the cut")

        # -- every name the rules and the dashboards use, against what the proxies exported -----------
        exported = {name for name in prometheus.api("label/__name__/values") if name.startswith("kthrottle_")}
        recorded = {name for name, rule in loaded.items() if rule["type"] == "recording"}
        uses = [(f"rule {name}", rule["query"]) for name, rule in loaded.items()]
        uses += [(f"dashboard {where}", expr) for where, expr in _dashboard_queries()]
        used = {(where, name) for where, expr in uses for name in _names(expr)}
        assert {name for _, name in used if name.startswith("kthrottle_")} >= {
            "kthrottle_upstream_up", "kthrottle_throttle_time_seconds_total",
            "kthrottle_upstream_latency_seconds_bucket"}, f"the name parser missed names: {sorted(used)}"
        missing = sorted((where, name) for where, name in used
                         if name not in (recorded if ":" in name else exported))
        assert not missing, (
            "names used that the proxies do not export (a counter is queried as <name>_total, a histogram "
            f"as <name>_bucket/_sum/_count): {missing}\nexported: {sorted(exported)}")
        assert proxy_a.alive() and proxy_b.alive()
    finally:
        if prometheus is not None:
            prometheus.stop()
        for proxy in started:
            with contextlib.suppress(Exception):
                proxy.stop()
