"""Demo traffic for `make run`: a producer as client-id "demo", so throttling shows at once.

It offers 1 KB records at a steady OFFERED_BYTES_PER_S, three times the example quota for "demo"
(deploy/quotas.toml: 100 KiB/s) and above the 200 KiB/s the README raises it to, and logs every
10 s the bytes per second the cluster acknowledged: that rate settles at the quota, and the
metrics show the throttle (kthrottle_throttles_total{client_id="demo"} rising).

It runs inside the proxy's process, so it must cost next to nothing. Two things keep it so:

- It is paced: at most OFFERED_BYTES_PER_S, whatever the quota (with no quota it does not flood the
  cluster), and at most MAX_PENDING records waiting for their acknowledgement.
- Its kafka-python client waits while a broker connection cannot take a request. kafka-python
  3.0.12's Sender, holding a batch for a broker whose connection is paused (client-side throttling
  after a response with throttle_time_ms, KIP-219, or max.in.flight reached), asks the client's
  `connection_delay()` how long to wait; that answers 0 for a connected broker (and seconds where
  the Sender reads milliseconds otherwise), so the Sender polled with timeout 0 in a loop: 0.6 to
  1 core while throttled, measured with `make run`. `_PollDelayClient` answers as Java's
  NetworkClient.pollDelayMs does: the throttle time left, else until a response or a timer wakes it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from typing import Any

from kafka.net.compat import KafkaNetClient

log = logging.getLogger("kthrottle.demo")

#: What the demo offers: 3 x the 100 KiB/s example quota, so it is throttled, visibly, also after
#: the README's step raising the quota to 200 KiB/s.
OFFERED_BYTES_PER_S = 3 * 102400
RECORD_BYTES = 1000
#: Records are handed to the producer in small groups this often (a steady rate, not bursts).
TICK_S = 0.1
#: Records waiting for their acknowledgement at most: a throttled demo offers no more until some
#: are acknowledged, so closing can flush them (kafka-python's close() flushes first and, on a
#: timeout, would leave its exit hook to try again).
MAX_PENDING = 50
#: How often the acknowledged rate is logged.
REPORT_S = 10.0


class _PollDelayClient(KafkaNetClient):  # type: ignore[misc]  # kafka-python is untyped
    """kafka-python's client with Java's poll delay for a broker the Sender cannot send to (see the
    module docstring); passed to KafkaProducer through its documented `kafka_client` setting."""

    def connection_delay(self, node_id: Any) -> float:
        """Milliseconds the Sender may wait before it tries `node_id` again."""
        if self.connected(node_id):
            # paused: for the throttle time left, else until a response arrives (a socket event
            # wakes the poll, and so does the timer that lifts a client-side throttle)
            return float(self.throttle_delay(node_id)) or float("inf")
        return float(super().connection_delay(node_id)) * 1000  # reconnect back-off, in seconds


class DemoProducer:
    def __init__(self, bootstrap: str, topic: str = "demo", client_id: str = "demo",
                 offered_bytes_per_s: int = OFFERED_BYTES_PER_S) -> None:
        self.bootstrap, self.topic, self.client_id = bootstrap, topic, client_id
        self.offered_bytes_per_s = offered_bytes_per_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="demo")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(12)

    def _run(self) -> None:
        from kafka import KafkaProducer
        from kafka.admin import KafkaAdminClient, NewTopic
        from kafka.errors import KafkaError, TopicAlreadyExistsError

        try:
            admin = KafkaAdminClient(bootstrap_servers=self.bootstrap, client_id="demo-admin")
            try:
                admin.create_topics([NewTopic(self.topic, 3, 1)])
            except TopicAlreadyExistsError:
                pass
            finally:
                admin.close()
            producer = KafkaProducer(bootstrap_servers=self.bootstrap, client_id=self.client_id,
                                     linger_ms=5, max_block_ms=1000, kafka_client=_PollDelayClient)
        except Exception as exc:  # the demo must never take the proxy down
            log.warning("demo traffic not started: %s", exc)
            return
        value = b"d" * RECORD_BYTES
        acknowledged = [0]

        def delivered(_metadata: object) -> None:
            acknowledged[0] += len(value)

        pending: deque[Any] = deque()
        per_tick = self.offered_bytes_per_s * TICK_S / RECORD_BYTES
        budget = 0.0  # records offered but not yet handed over (fractions carry to the next tick)
        mark = next_tick = time.monotonic()
        while not self._stop.is_set():
            while pending and pending[0].is_done:
                pending.popleft()
            budget = min(budget + per_tick, per_tick + 1)  # no burst after a wait
            while budget >= 1 and len(pending) < MAX_PENDING:
                budget -= 1
                try:
                    future = producer.send(self.topic, value)
                except KafkaError:
                    break
                future.add_callback(delivered)
                pending.append(future)
            now = time.monotonic()
            if now - mark >= REPORT_S:
                log.info("demo producer (client.id=%s): %.0f bytes/s acknowledged over the last %.0f s "
                         "(offering %d bytes/s)", self.client_id, acknowledged[0] / (now - mark), now - mark,
                         self.offered_bytes_per_s)
                acknowledged[0], mark = 0, now
            next_tick = max(next_tick + TICK_S, now)
            self._stop.wait(next_tick - now)
        with contextlib.suppress(KafkaError):
            producer.close(timeout=10)
