"""The docker-compose stack (kafka, kthrottle, prometheus, grafana) and its Grafana dashboard.

No Docker engine is needed: `docker-compose config` only parses and validates the file, and the
dashboard is checked against the metrics a real `kthrottle run` exports after real traffic, so a
query naming a metric the proxy does not have (a typo, a missing `_total`) fails here instead of
drawing an empty panel.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic
from prometheus_client.parser import text_string_to_metric_families

from config.quotas import load_quota_file
from config.settings import load_settings
from harness.local_kafka import LocalKafka
from quotas.entity import QuotaEntity
from quotas.types import QuotaType

from .clients import topic_name
from .proxies import REPO, RunningProxy, free_port_block

COMPOSE_FILE = REPO / "docker-compose.yml"
DEPLOY = REPO / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "kthrottle.json"
SERVICES = {"kafka", "kthrottle", "prometheus", "grafana"}
INSTALL_HINT = "no docker-compose found: run `apt-get install -y docker-compose` (Debian 12 ships 1.29.2)"

METRIC_NAME = re.compile(r"\bkthrottle_[a-z_]+")

#: Every series the dashboard must chart (the brief of the dashboard), by its PromQL name.
REQUIRED_ON_DASHBOARD = {
    "kthrottle_produce_byte_rate_bytes_per_second", "kthrottle_fetch_byte_rate_bytes_per_second",
    "kthrottle_request_time_percent", "kthrottle_producer_id_rate_per_second", "kthrottle_quota_limit",
    "kthrottle_throttle_time_avg_seconds", "kthrottle_throttle_time_max_seconds",
    "kthrottle_throttled_responses_total", "kthrottle_muted_connections", "kthrottle_connections",
    "kthrottle_requests_total", "kthrottle_upstream_latency_seconds_bucket",
}

DASH = "dash"
#: Quotas of the live run: 1000 B/s for client "dash" (so ~200 KB must throttle it) and a
#: producer-id quota for every user (so the idempotent producer's id is charged), an ip quota never
#: reached for every address (so the per-ip series exist). And a cluster capacity never reached,
#: adaptive (so the capacity row's series, the factor's included, exist).
LIVE_QUOTAS = f"""\
[[quota]]
client_id = "{DASH}"
producer_byte_rate = 1000
consumer_byte_rate = 1000
request_percentage = 1.0

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


# -- docker-compose config ----------------------------------------------------------------------


def _compose_command() -> list[str]:
    """`docker-compose` (Debian's 1.29 or the v2 standalone), else the `docker compose` plugin."""
    binary = shutil.which("docker-compose")
    if binary:
        return [binary]
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True,
                                 check=False, timeout=60).returncode == 0:
        return [docker, "compose"]
    pytest.fail(INSTALL_HINT, pytrace=False)


def _compose(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*_compose_command(), "-f", str(COMPOSE_FILE), *args], cwd=REPO,
                          capture_output=True, text=True, check=False, timeout=120)


def _compose_model() -> dict[str, Any]:
    """The normalised compose model as data: v2 prints JSON itself; for 1.29 (which prints only YAML)
    the YAML is read by the Python that runs docker-compose, which has PyYAML since compose needs it."""
    done = _compose("config", "--format", "json")
    if done.returncode == 0 and done.stdout.lstrip().startswith("{"):
        return json.loads(done.stdout)
    done = _compose("config")
    assert done.returncode == 0, f"docker-compose config failed:\n{done.stderr}"
    script = Path(_compose_command()[0])
    shebang = script.read_bytes()[:200].split(b"\n", 1)[0].decode(errors="replace")
    assert shebang.startswith("#!"), f"{script} is neither compose v2 (--format json) nor a Python script"
    loader = "import json, sys, yaml; json.dump(yaml.safe_load(sys.stdin), sys.stdout)"
    converted = subprocess.run([*shebang[2:].split(), "-c", loader], input=done.stdout,
                               capture_output=True, text=True, check=False, timeout=60)
    assert converted.returncode == 0, f"could not read docker-compose's YAML:\n{converted.stderr}"
    return json.loads(converted.stdout)


def _flags(command: list[str]) -> dict[str, str]:
    """`--name value` pairs of a command line."""
    assert len(command) % 2 == 0, f"flags without values in {command}"
    return dict(zip(command[::2], command[1::2], strict=True))


def _published(service: dict[str, Any]) -> set[int]:
    """Host ports, from either compose version's normalised form."""
    ports = set()
    for port in service.get("ports", []):
        if isinstance(port, dict):
            assert int(port["published"]) == int(port["target"]), f"port remapped: {port}"
            ports.add(int(port["published"]))
        else:
            ports.add(int(str(port).split(":")[0]))
    return ports


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    """Container path -> host path of bind mounts (1.29 prints "src:dst:ro", v2 prints objects)."""
    mounts = {}
    for volume in service.get("volumes", []):
        if isinstance(volume, dict):
            mounts[volume["target"]] = volume["source"]
        else:
            source, target = str(volume).split(":")[:2]
            mounts[target] = source
    return mounts


def test_compose_config_parses_and_names_the_four_services() -> None:
    done = _compose("config")
    assert done.returncode == 0, f"docker-compose config exited {done.returncode}:\n{done.stderr}"
    for service in SERVICES:
        assert re.search(rf"^\s+{service}:\s*$", done.stdout, re.MULTILINE), (
            f"service {service} not in `docker-compose config` output:\n{done.stdout}")
    listed = _compose("config", "--services")
    assert listed.returncode == 0, listed.stderr
    assert set(listed.stdout.split()) == SERVICES


def test_compose_services_agree_with_each_other() -> None:
    """Ports, mounts and addresses line up across kthrottle's flags, Kafka, Prometheus and Grafana."""
    services = _compose_model()["services"]
    kafka, kthrottle, grafana = services["kafka"], services["kthrottle"], services["grafana"]

    env = {key: str(value) for key, value in kafka["environment"].items()}
    assert env["KAFKA_PROCESS_ROLES"].replace(" ", "") in ("broker,controller", "controller,broker")
    node_id = int(env["KAFKA_NODE_ID"])
    assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == f"{node_id}@kafka:9093"
    assert env["KAFKA_OFFSETS_TOPIC_REPLICATION_FACTOR"] == "1"
    assert env["KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR"] == "1"
    advertised = re.fullmatch(r"PLAINTEXT://([^,]+)", env["KAFKA_ADVERTISED_LISTENERS"])
    assert advertised, env["KAFKA_ADVERTISED_LISTENERS"]

    assert "build" in kthrottle
    flags = _flags([str(arg) for arg in kthrottle["command"]])
    assert flags["--upstream"] == advertised.group(1), "the proxy must front the broker's advertised listener"
    listen_port = int(flags["--listen"].rsplit(":", 1)[1])
    assert flags["--listen"].startswith("0.0.0.0:"), "in a container the proxy must listen on all addresses"
    metrics_port = int(flags["--metrics-port"])
    assert _published(kthrottle) >= {listen_port, listen_port + 1 + node_id, metrics_port}, (
        f"bootstrap {listen_port}, node {node_id} on {listen_port + 1 + node_id} and metrics "
        f"{metrics_port} must all be published: {kthrottle.get('ports')}")
    quota_source = _mounts(kthrottle)[flags["--config"]]
    assert Path(quota_source).resolve() == (DEPLOY / "quotas.toml").resolve()

    prometheus_config = Path(_mounts(services["prometheus"])["/etc/prometheus/prometheus.yml"])
    assert prometheus_config.resolve() == (DEPLOY / "prometheus.yml").resolve()
    text = prometheus_config.read_text()
    assert re.search(rf"""targets:\s*\[\s*["']kthrottle:{metrics_port}["']\s*\]""", text), text
    assert re.search(r"^\s*scrape_interval:\s*5s\s*$", text, re.MULTILINE), text

    genv = {key: str(value).lower() for key, value in grafana["environment"].items()}
    assert genv["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert genv["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "viewer"
    assert 3000 in _published(grafana)
    grafana_mounts = _mounts(grafana)
    provisioning = Path(grafana_mounts["/etc/grafana/provisioning"])
    assert provisioning.resolve() == (DEPLOY / "grafana" / "provisioning").resolve()
    datasource = (provisioning / "datasources" / "prometheus.yml").read_text()
    assert re.search(r"^\s*uid:\s*prometheus\s*$", datasource, re.MULTILINE), datasource
    assert re.search(r"^\s*url:\s*http://prometheus:9090\s*$", datasource, re.MULTILINE), datasource
    provider = (provisioning / "dashboards" / "dashboards.yml").read_text()
    path = re.search(r"^\s*path:\s*(\S+)\s*$", provider, re.MULTILINE)
    assert path, provider
    assert Path(grafana_mounts[path.group(1)]).resolve() == DASHBOARD.parent.resolve()


def test_example_quota_file_parses() -> None:
    path = DEPLOY / "quotas.toml"
    table = load_quota_file(path)
    assert table, "the example quota file defines no quota"
    assert table[QuotaEntity("<default>", None)] == {QuotaType.PRODUCER_IDS: 20.0}
    assert QuotaType.PRODUCE in table[QuotaEntity(None, "demo")]
    # The stack passes it as --config, so its [proxy] table must be valid settings too.
    load_settings(path)


# -- the dashboard against a real proxy's metrics ---------------------------------------------------


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # a collapsed row holds its panels


def _queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    queries = [(f"panel {panel.get('title')!r}", target["expr"])
               for panel in _panels(dashboard["panels"]) for target in panel.get("targets", [])]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            query = variable.get("query")
            text = query.get("query", "") if isinstance(query, dict) else str(query or "")
            queries.append((f"variable {variable['name']!r}", text or variable.get("definition", "")))
    return queries


def test_dashboard_is_provisionable() -> None:
    dashboard = _dashboard()
    assert dashboard["uid"] == "kthrottle"
    assert 36 <= dashboard["schemaVersion"] <= 41
    ids = [panel["id"] for panel in _panels(dashboard["panels"])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    charts = [panel for panel in _panels(dashboard["panels"]) if panel["type"] != "row"]
    assert charts
    for panel in charts:
        assert panel["datasource"] == {"type": "prometheus", "uid": "prometheus"}, panel["title"]
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            assert target["expr"].strip() and target["refId"], panel["title"]
    named = {name for _, expr in _queries(dashboard) for name in METRIC_NAME.findall(expr)}
    assert named >= REQUIRED_ON_DASHBOARD, f"not charted: {sorted(REQUIRED_ON_DASHBOARD - named)}"
    exprs = " ".join(expr for _, expr in _queries(dashboard))
    for quantile in ("0.5", "0.99"):
        assert f"histogram_quantile({quantile}, " in exprs


Samples = list[tuple[str, dict[str, str], float]]


@dataclass
class LiveRun:
    """Two scrapes of /metrics, as (sample name, labels, value): right after the throttled produce
    (rates and throttle times are measured over the ~11 s quota window, so they fade after it) and
    at the end, after the consumer (so every series of the run exists)."""

    after_produce: Samples
    final: Samples
    consumed: int

    @property
    def names(self) -> set[str]:
        """The series names PromQL can select: sample names, i.e. with `_total`, `_bucket`, `_sum`,
        `_count` and `_created` where the exposition has them (a counter family `x` is queried as
        `x_total`, never as `x`)."""
        return {name for name, _, _ in self.final}


def _scrape(port: int) -> Samples:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return [(sample.name, dict(sample.labels), sample.value)
            for family in text_string_to_metric_families(text) for sample in family.samples]


def _values(samples: Samples, name: str, **labels: str) -> list[float]:
    return [value for sample, got, value in samples
            if sample == name and all(got.get(k) == v for k, v in labels.items())]


def _produce(bootstrap: str, topic: str, partition: int, count: int, size: int) -> None:
    """`count` records of `size` incompressible bytes in one batch (so in one Produce request)."""
    producer = Producer({"bootstrap.servers": bootstrap, "client.id": DASH, "enable.idempotence": True,
                         "linger.ms": 1000, "batch.size": 1_000_000, "compression.type": "none"})
    errors: list[str] = []
    delivered = 0

    def report(err: KafkaError | None, _msg: object) -> None:
        nonlocal delivered
        if err is not None:
            errors.append(str(err))
        else:
            delivered += 1

    for i in range(count):
        value = f"{i:08d}".encode() + bytes((i * 7919 + j * 31) % 251 for j in range(size - 8))
        producer.produce(topic, value, partition=partition, on_delivery=report)
    left = producer.flush(60)
    assert left == 0 and not errors and delivered == count, (
        f"{delivered}/{count} delivered, {left} still queued, errors {errors[:3]}")


def _consume(bootstrap: str, topic: str, partition: int, expected: int) -> int:
    consumer = Consumer({"bootstrap.servers": bootstrap, "client.id": DASH, "group.id": f"{DASH}-group",
                         "enable.auto.commit": False})
    consumer.assign([TopicPartition(topic, partition, OFFSET_BEGINNING)])
    got = 0
    deadline = time.monotonic() + 60
    try:
        while got < expected and time.monotonic() < deadline:
            for message in consumer.consume(100, timeout=0.5):
                assert not message.error(), message.error()
                assert int(message.value()[:8]) == got, "records out of order"
                got += 1
    finally:
        consumer.close()
    return got


@pytest.fixture(scope="module")
def live_run(kafka_cluster: LocalKafka, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRun]:
    """A real `kthrottle run --metrics-port --config` with quotas, and real traffic as client "dash".

    ~200 KB are produced as "dash": 5 KB first (under the quota), then ~195 KB in one Produce
    request, which the 1000 B/s quota throttles for minutes; the proxy answers it at once (KIP-219)
    and mutes, and nothing of that client produces again. The small batch is on its own partition
    and is what the consumer (also "dash") reads back: the big batch would be fetched whole (a
    fetch always returns its first batch) and throttled, so it is left where it is. The 1% request
    quota holds many of the consumer's requests for up to a second each, as a broker would.
    """
    workdir = tmp_path_factory.mktemp("compose-dash")
    config = workdir / "kthrottle.toml"
    config.write_text(LIVE_QUOTAS)
    metrics_port = free_port_block(1)
    proxy = RunningProxy(kafka_cluster.bootstrap,
                         extra_args=["--metrics-port", str(metrics_port), "--config", str(config)])
    try:
        topic = topic_name("dash")
        admin = AdminClient({"bootstrap.servers": proxy.bootstrap, "client.id": f"{DASH}-admin"})
        admin.create_topics([NewTopic(topic, 2, 1)])[topic].result(30)
        _produce(proxy.bootstrap, topic, partition=0, count=5, size=1000)
        _produce(proxy.bootstrap, topic, partition=1, count=195, size=1000)
        after_produce = _scrape(metrics_port)
        consumed = _consume(proxy.bootstrap, topic, partition=0, expected=5)
        yield LiveRun(after_produce, _scrape(metrics_port), consumed)
        assert proxy.alive(), f"the proxy died:\n{proxy.log()[-3000:]}"
    finally:
        proxy.stop()


def test_traffic_went_through_the_quota_proxy(live_run: LiveRun) -> None:
    assert live_run.consumed == 5, f"consumed {live_run.consumed} of the 5 small records"


def test_every_dashboard_query_names_only_exported_metrics(live_run: LiveRun) -> None:
    exported = live_run.names
    missing = [(where, name) for where, expr in _queries(_dashboard())
               for name in METRIC_NAME.findall(expr) if name not in exported]
    assert not missing, (f"dashboard queries name metrics the proxy does not export: {missing}; "
                         f"exported: {sorted(exported)}")


def test_the_quota_of_dash_shows_and_throttled(live_run: LiveRun) -> None:
    after, final = live_run.after_produce, live_run.final
    dash = {"client_id": DASH}
    produce = _values(after, "kthrottle_produce_byte_rate_bytes_per_second", **dash)
    assert produce and max(produce) > 1000, f"produce byte rate of {DASH!r} after ~200 KB: {produce}"
    assert _values(final, "kthrottle_produce_byte_rate_bytes_per_second", **dash)
    assert _values(final, "kthrottle_fetch_byte_rate_bytes_per_second", **dash)
    assert _values(final, "kthrottle_request_time_percent", **dash)
    assert _values(final, "kthrottle_producer_id_rate_per_second", quota="producer_ids_rate")
    assert _values(final, "kthrottle_quota_limit", quota="producer_byte_rate", **dash) == [1000.0]
    throttles = _values(final, "kthrottle_throttles_total", quota="producer_byte_rate", **dash)
    assert throttles and sum(throttles) > 0, f"the 1000 B/s produce quota never throttled: {throttles}"
    # ~195 KB over a 1000 B/s quota measured over 10 s: Kafka's formula gives ~190 s.
    assert max(_values(after, "kthrottle_throttle_time_max_seconds", quota="producer_byte_rate",
                       **dash)) > 100
    assert sum(_values(final, "kthrottle_throttle_time_seconds_total", quota="producer_byte_rate",
                       **dash)) > 100
    assert sum(_values(final, "kthrottle_throttled_responses_total", api="Produce")) > 0
