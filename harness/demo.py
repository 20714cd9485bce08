"""Demo traffic for `make run`: a producer as client-id "demo", so throttling shows at once.

It produces 1 KB records as fast as the proxy lets it and logs the bytes per second the cluster
acknowledged; with the example quotas (deploy/quotas.toml: 100 KiB/s for "demo") that rate settles
at the quota and the metrics show the throttle.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque

log = logging.getLogger("kthrottle.demo")


class DemoProducer:
    def __init__(self, bootstrap: str, topic: str = "demo", client_id: str = "demo") -> None:
        self.bootstrap, self.topic, self.client_id = bootstrap, topic, client_id
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
                                     linger_ms=5, max_block_ms=1000)
        except Exception as exc:  # the demo must never take the proxy down
            log.warning("demo traffic not started: %s", exc)
            return
        value = b"d" * 1000
        acknowledged = [0]

        def delivered(_metadata: object) -> None:
            acknowledged[0] += len(value)

        # At most 50 records in flight, so that closing can flush them (kafka-python's close()
        # flushes first and, on a timeout, would leave its exit hook to try again).
        pending: deque[object] = deque()
        mark = time.monotonic()
        while not self._stop.is_set():
            while pending and pending[0].is_done:  # type: ignore[attr-defined]
                pending.popleft()
            if len(pending) >= 50:
                time.sleep(0.01)
                continue
            try:
                future = producer.send(self.topic, value)
            except KafkaError:
                continue
            future.add_callback(delivered)
            pending.append(future)
            now = time.monotonic()
            if now - mark >= 10:
                log.info("demo producer (client.id=%s): %.0f bytes/s acknowledged over the last %.0f s",
                         self.client_id, acknowledged[0] / (now - mark), now - mark)
                acknowledged[0], mark = 0, now
        with contextlib.suppress(KafkaError):
            producer.close(timeout=10)
