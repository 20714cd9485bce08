"""Running the real `kthrottle run` command in front of the real cluster, for integration tests.

The proxy runs as its own process, exactly as users run it, and its log is kept so tests can
check what it saw (principals, close reasons).
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Self

from harness.ports import free_port_block

REPO = Path(__file__).resolve().parents[2]

__all__ = ["REPO", "QuotaProxy", "RunningProxy", "free_port_block"]


class RunningProxy:
    """`kthrottle run` as a subprocess, with its log in a file."""

    def __init__(self, upstream: str, *, extra_args: list[str] | None = None, max_node_id: int = 9,
                 nofile: int | None = None) -> None:
        """`nofile`: run the proxy with this file-descriptor limit (soft and hard), to test running out."""
        self.port = free_port_block(max_node_id + 2)
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.upstream = upstream
        # Open for the proxy's whole life (closed in stop()), so no context manager.
        self._log = tempfile.NamedTemporaryFile(prefix="kthrottle-", suffix=".log", delete=False)  # noqa: SIM115
        self.log_path = Path(self._log.name)
        cmd = [sys.executable, "-m", "cli", "run", "--upstream", upstream,
               "--listen", self.bootstrap, *(extra_args or [])]
        def limit_descriptors() -> None:
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.process = subprocess.Popen(cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
                                        start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                        preexec_fn=limit_descriptors if nofile is not None else None)
        deadline = time.monotonic() + 30
        while "bootstrap.servers=" not in self.log():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"kthrottle did not start (exit {self.process.returncode}):\n{self.log()}")
            time.sleep(0.05)

    def node_port(self, node_id: int) -> int:
        return self.port + 1 + node_id

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, text: str, timeout: float = 10.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            log = self.log()
            if text in log:
                return log
            time.sleep(0.05)
        raise AssertionError(f"{text!r} not in the proxy log within {timeout}s:\n{self.log()[-4000:]}")

    def alive(self) -> bool:
        return self.process.poll() is None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()


class QuotaProxy(RunningProxy):
    """A proxy with a quota file that tests rewrite (and reload with SIGHUP), and metrics.

    `settings` is the `[proxy]` table text kept at the top of the file across reloads.
    """

    def __init__(self, upstream: str, workdir: Path, settings: str = "") -> None:
        self.config_path = workdir / "kthrottle.toml"
        self.settings = settings
        self.config_path.write_text(f"[proxy]\n{settings}\n")
        self.metrics_port = free_port_block(1)
        super().__init__(upstream, extra_args=["--config", str(self.config_path),
                                               "--metrics-port", str(self.metrics_port)])

    def set_quotas(self, quotas: str) -> None:
        """Replace every quota; returns once the proxy has applied the file."""
        before = self.log().count("quotas from ")
        self.config_path.write_text(f"[proxy]\n{self.settings}\n\n{quotas}\n")
        os.kill(self.process.pid, signal.SIGHUP)
        deadline = time.monotonic() + 10
        while self.log().count("quotas from ") <= before:
            if time.monotonic() > deadline:
                raise AssertionError(f"the proxy did not reload its quotas:\n{self.log()[-3000:]}")
            time.sleep(0.05)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of /metrics, keyed by (name, sorted labels)."""
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read()
        samples = {}
        for family in text_string_to_metric_families(text.decode()):
            for sample in family.samples:
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return samples

    def metric(self, name: str, **labels: str) -> float:
        """One series' value, or the sum of the series whose labels include `labels` (the throttle
        counters' `mode` then sums enforced and shadow); 0 when there is none yet."""
        want = set(labels.items())
        return sum(value for (got, series), value in self.metrics().items()
                   if got == name and want <= set(series))
