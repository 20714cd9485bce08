"""`make run`'s demo producer (`kthrottle run --demo`, in the proxy's process) is throttled, visibly,
and costs next to nothing: kafka-python 3.0.12's Sender busy-polled while its connection was paused
for a throttle, and the proxy process used 0.6 to 0.85 of a core holding it at 100 KiB/s."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.local_kafka import LocalKafka

from .clients import wait_until
from .proxies import REPO, RunningProxy, free_port_block
from .quota_runs import report

#: The demo's CPU bound.
pytestmark = pytest.mark.quiet

#: How long the CPU time is measured, and the bound: a generous one (measured: about 0.05 core).
MEASURE_S = 20.0
MAX_CORES = 0.10
#: The demo's quota in deploy/quotas.toml (client_id = "demo", producer_byte_rate).
DEMO_QUOTA = 102400
DEMO = (("client_id", "demo"), ("mode", "enforced"), ("quota", "producer_byte_rate"), ("user", ""))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of the process, all its threads (/proc/PID/stat utime and stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def produced_bytes(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> float:
    return sum(value for (name, labels), value in samples.items()
               if name == "kthrottle_request_bytes_total" and dict(labels).get("api") == "Produce")


def test_the_demo_is_throttled_and_costs_next_to_nothing(kafka_cluster: LocalKafka) -> None:
    metrics_port = free_port_block(1)
    args = ["--config", str(REPO / "deploy" / "quotas.toml"), "--metrics-port", str(metrics_port), "--demo"]
    with RunningProxy(kafka_cluster.bootstrap, extra_args=args) as running:
        wait_until(lambda: scrape(metrics_port).get(("kthrottle_throttles_total", DEMO), 0) > 0, 90,
                   "the demo producer to be throttled")
        time.sleep(5)  # past the start: topic creation, metadata, the first burst
        pid = running.process.pid
        before, cpu_before, began = scrape(metrics_port), cpu_seconds(pid), time.monotonic()
        time.sleep(MEASURE_S)
        after, cpu_after, ended = scrape(metrics_port), cpu_seconds(pid), time.monotonic()
        assert running.alive(), running.log()[-3000:]
    cores = (cpu_after - cpu_before) / (ended - began)
    throttles = after[("kthrottle_throttles_total", DEMO)] - before[("kthrottle_throttles_total", DEMO)]
    produced = (produced_bytes(after) - produced_bytes(before)) / (ended - began)
    report(f"proxy process with the demo: {cores:.3f} core over {ended - began:.1f} s; "
           f"{throttles:.0f} throttled responses, {produced:.0f} produce request bytes/s")
    assert cores < MAX_CORES, f"the proxy process used {cores:.2f} core with the demo running"
    assert throttles > 0, "the demo was not throttled while measured"
    assert 0.5 * DEMO_QUOTA < produced < 2 * DEMO_QUOTA, produced
