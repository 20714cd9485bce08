"""The overload bed's clients, each in a process of its own (issue 27).

Why processes: librdkafka's delivery callbacks run in Python, under one GIL. With the flat-out
producers in the same process as gold, gold's measured latency was mostly the wait for the GIL,
which is the client's queue, not the broker's. Here gold has a process to itself and the
producers another, so what gold measures is the proxy and the broker.

Run as `python -m tests.integration.bed_clients gold|flat|consume|fetch BOOTSTRAP TOPIC SECONDS [options]`;
each prints one JSON line when done. `BedClient` starts one and reads that line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaError, Producer

from tests.integration.paced_fetcher import fetch_paced
from tests.integration.quota_runs import RunResult, consume_for, produce_for

REPO = Path(__file__).resolve().parents[2]

#: gold: acks=all 1 KB records at this many per second (the issue's protected tenant)
GOLD_RATE = 200
GOLD_RECORD = 1000


def _tls(ssl_ca: str | None) -> dict[str, str]:
    """librdkafka over the broker's SSL listener, trusting `ssl_ca` (none: plaintext)."""
    return {} if ssl_ca is None else {"security.protocol": "SSL", "ssl.ca.location": ssl_ca}


def gold(bootstrap: str, topic: str, seconds: float, client_id: str,
         ssl_ca: str | None = None) -> dict[str, Any]:
    """Each record's produce-to-ack latency in ms, in the order sent, and the errors."""
    producer = Producer({"bootstrap.servers": bootstrap, "client.id": client_id, "acks": "all",
                         "linger.ms": 0, **_tls(ssl_ca)})
    latencies: list[tuple[float, float]] = []
    errors: list[str] = []
    value = b"g" * GOLD_RECORD
    start = time.monotonic()
    sent = 0
    while time.monotonic() - start < seconds:
        wait = start + sent / GOLD_RATE - time.monotonic()
        if wait > 0:
            producer.poll(min(wait, 0.01))  # never negative: librdkafka waits forever then
            continue
        at = time.monotonic()

        def done(err: KafkaError | None, _msg: object, at: float = at) -> None:
            if err is not None:
                errors.append(str(err))
            else:
                latencies.append((at - start, (time.monotonic() - at) * 1000.0))

        producer.produce(topic, value, on_delivery=done)
        sent += 1
        producer.poll(0)
    producer.flush(120)
    return {"latencies": latencies, "errors": errors[:5], "sent": sent}


def flat(bootstrap: str, topic: str, seconds: float, producers: int, value_bytes: int,
         batch_bytes: int, offered_rate: float | None = None) -> dict[str, Any]:
    """`producers` librdkafka producers flat out (acks=all, quota_runs.produce_for), each its own
    client id `best-effort-<n>`; every acknowledged record's time, per producer. `offered_rate`:
    each sends at this many bytes/s, evenly, instead (the bench's paced path)."""
    value = os.urandom(value_bytes)  # incompressible: the broker's gzip works for every byte
    start = time.monotonic()
    results: list[RunResult | None] = [None] * producers

    def run(n: int) -> None:
        results[n] = produce_for(bootstrap, topic, seconds, value=value, offered_rate=offered_rate, **{
            "client.id": f"best-effort-{n}", "acks": "all", "batch.size": batch_bytes})

    threads = [threading.Thread(target=run, args=(n,)) for n in range(producers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    acked = [[at - start for at, _size in result.events] for result in results if result is not None]
    assert len(acked) == producers, "a producer thread failed (its error is above)"
    return {"acked": acked, "value_bytes": value_bytes, "errors": []}


def consume(bootstrap: str, topic: str, seconds: float, consumers: int,
            ssl_ca: str | None = None) -> dict[str, Any]:
    """`consumers` librdkafka consumers flat out, each in a group of its own from the earliest
    offset (a backlog to catch up on), client id `best-effort-<n>`; the record bytes each received
    in each second."""
    start = time.monotonic()
    per_second: list[list[int]] = [[0] * (int(seconds) + 1) for _ in range(consumers)]
    failed: list[str] = []

    def run(n: int) -> None:
        try:
            result, _offsets = consume_for(bootstrap, topic, seconds, **{
                "group.id": f"best-effort-{n}-{os.getpid()}", "client.id": f"best-effort-{n}",
                "enable.auto.commit": False, **_tls(ssl_ca)})
        except Exception as error:  # reported in the JSON line: the caller's assertion names it
            failed.append(repr(error))
            return
        failed.extend(result.errors[:2])
        for at, size in result.events:
            second = min(int(at - start), int(seconds))
            per_second[n][second] += size

    threads = [threading.Thread(target=run, args=(n,)) for n in range(consumers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"consumed": per_second, "errors": failed[:5]}


@dataclass
class BedResult:
    """What one client process printed."""

    data: dict[str, Any]

    def gold_percentiles(self, after_s: float) -> tuple[float, float]:
        """Gold's p50 and p99 (ms) over the records sent after `after_s`."""
        samples = sorted(latency for at, latency in self.data["latencies"] if at >= after_s)
        assert len(samples) > 100 and not self.data["errors"], (len(samples), self.data["errors"])
        return samples[len(samples) // 2], samples[int(0.99 * (len(samples) - 1))]

    def goodput(self, start_s: float, end_s: float) -> float:
        """Acknowledged bytes/s of the flat-out producers between `start_s` and `end_s`."""
        count = sum(1 for times in self.data["acked"] for t in times if start_s <= t < end_s)
        return count * self.data["value_bytes"] / (end_s - start_s)

    def consumed(self, start_s: int, end_s: int) -> float:
        """Record bytes/s the flat-out consumers received between whole seconds `start_s` and `end_s`."""
        assert not self.data["errors"], self.data["errors"]
        return sum(sum(seconds[start_s:end_s]) for seconds in self.data["consumed"]) / (end_s - start_s)


class BedClient:
    """One client process; `result()` waits for its line."""

    def __init__(self, *args: str) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", "tests.integration.bed_clients", *args],
                                        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def result(self, timeout: float = 180) -> BedResult:
        out, err = self.process.communicate(timeout=timeout)
        assert self.process.returncode == 0, f"bed client failed ({self.process.returncode}):\n{err[-3000:]}"
        return BedResult(json.loads(out.strip().splitlines()[-1]))


def start_gold(bootstrap: str, topic: str, seconds: float, client_id: str = "gold",
               ssl_ca: str | None = None) -> BedClient:
    tls = [] if ssl_ca is None else ["--ssl-ca", ssl_ca]
    return BedClient("gold", bootstrap, topic, str(seconds), "--client-id", client_id, *tls)


def start_consumers(bootstrap: str, topic: str, seconds: float, consumers: int = 3,
                    ssl_ca: str | None = None) -> BedClient:
    tls = [] if ssl_ca is None else ["--ssl-ca", ssl_ca]
    return BedClient("consume", bootstrap, topic, str(seconds), "--consumers", str(consumers), *tls)


def start_paced_fetcher(bootstrap: str, topic: str, partitions: int, seconds: float, offered_rate: float,
                        ssl_ca: str | None = None) -> BedClient:
    """One consumer reading `offered_rate` bytes/s evenly, one Fetch at a time (paced_fetcher.py)."""
    tls = [] if ssl_ca is None else ["--ssl-ca", ssl_ca]
    return BedClient("fetch", bootstrap, topic, str(seconds), "--partitions", str(partitions),
                     "--offered-rate", str(offered_rate), *tls)


def start_flat(bootstrap: str, topic: str, seconds: float, producers: int = 3, value_bytes: int = 4000,
               batch_bytes: int = 16384, offered_rate: float | None = None) -> BedClient:
    paced = [] if offered_rate is None else ["--offered-rate", str(offered_rate)]
    return BedClient("flat", bootstrap, topic, str(seconds), "--producers", str(producers),
                     "--value-bytes", str(value_bytes), "--batch-bytes", str(batch_bytes), *paced)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=["gold", "flat", "consume", "fetch"])
    parser.add_argument("bootstrap")
    parser.add_argument("topic")
    parser.add_argument("seconds", type=float)
    parser.add_argument("--client-id", default="gold")
    parser.add_argument("--producers", type=int, default=3)
    parser.add_argument("--value-bytes", type=int, default=4000)
    parser.add_argument("--batch-bytes", type=int, default=16384)
    parser.add_argument("--offered-rate", type=float, default=None)
    parser.add_argument("--consumers", type=int, default=3)
    parser.add_argument("--partitions", type=int, default=1)
    parser.add_argument("--ssl-ca", default=None)
    args = parser.parse_args()
    if args.kind == "gold":
        out = gold(args.bootstrap, args.topic, args.seconds, args.client_id, args.ssl_ca)
    elif args.kind == "consume":
        out = consume(args.bootstrap, args.topic, args.seconds, args.consumers, args.ssl_ca)
    elif args.kind == "fetch":
        if args.offered_rate is None:
            parser.error("fetch needs --offered-rate (bytes/s)")
        out = fetch_paced(args.bootstrap, args.topic, args.partitions, args.seconds, args.offered_rate,
                          args.ssl_ca)
    else:
        out = flat(args.bootstrap, args.topic, args.seconds, args.producers, args.value_bytes,
                   args.batch_bytes, args.offered_rate)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
