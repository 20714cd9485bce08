"""The Prometheus rules in deploy/prometheus/alerts.yml, checked and unit-tested by promtool.

`promtool test rules` runs deploy/prometheus/alerts_test.yml: input series shaped like the proxy's
own, and for every alert the times it must fire and the times it must not. promtool comes with
Debian's prometheus package, which `make tools` installs; without it these tests fail (a skipped
check would pass CI with rules nobody has loaded). tests/integration/test_alerts.py runs the same
rules in a real Prometheus against real proxies.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
RULES = DEPLOY / "prometheus" / "alerts.yml"
RULE_TESTS = DEPLOY / "prometheus" / "alerts_test.yml"
PROMETHEUS_CONFIG = DEPLOY / "prometheus.yml"
COMPOSE_FILE = REPO / "docker-compose.yml"
INSTALL_HINT = ("promtool not found: run `make tools` (it installs Debian's prometheus package, "
                "which has /usr/bin/promtool)")

ALERT = re.compile(r"^\s*- alert:\s*(\w+)\s*$", re.MULTILINE)


def _promtool(*args: str) -> str:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.fail(INSTALL_HINT, pytrace=False)
    done = subprocess.run([binary, *args], cwd=REPO, capture_output=True, text=True, check=False,
                          timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"promtool {' '.join(args)} exited {done.returncode}:\n{output}"
    return output


def _alert_blocks() -> dict[str, str]:
    """Alert name -> its text in alerts.yml, up to the next rule."""
    text = RULES.read_text()
    starts = [*ALERT.finditer(text)]
    return {match.group(1): text[match.start():following.start() if following else len(text)]
            for match, following in zip(starts, [*starts[1:], None], strict=True)}


def test_promtool_checks_the_rules() -> None:
    output = _promtool("check", "rules", str(RULES))
    assert "SUCCESS" in output, output


def test_promtool_unit_tests_of_the_rules_pass() -> None:
    output = _promtool("test", "rules", str(RULE_TESTS))
    assert "SUCCESS" in output, output


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    tests = RULE_TESTS.read_text()
    cases = re.findall(r"alertname:\s*(\w+)\s*\n\s*exp_alerts:\s*(\[\])?", tests)
    firing = {name for name, empty in cases if not empty}
    quiet = {name for name, empty in cases if empty}
    alerts = set(_alert_blocks())
    assert alerts, f"no alert in {RULES}"
    assert not alerts - firing, f"alerts never tested firing: {sorted(alerts - firing)}"
    assert not alerts - quiet, f"alerts never tested not firing: {sorted(alerts - quiet)}"
    unknown = (firing | quiet) - alerts
    assert not unknown, f"tests of alerts that do not exist: {sorted(unknown)}"


def test_every_alert_has_a_for_a_severity_and_annotations_naming_the_instance() -> None:
    for name, block in _alert_blocks().items():
        assert re.search(r"^\s+for:\s*\d+[smh]\s*$", block, re.MULTILINE), f"{name} has no for:"
        assert re.search(r"^\s+severity:\s*(critical|warning|info)\s*$", block, re.MULTILINE), (
            f"{name} has no severity label")
        for annotation in ("summary", "description"):
            text = re.search(rf"^\s+{annotation}:(.*?)(?=^\s+\w+:|\Z)", block, re.MULTILINE | re.DOTALL)
            assert text, f"{name} has no {annotation}"
            assert "{{ $labels.instance }}" in text.group(1), (
                f"{name}'s {annotation} does not name the instance")


def test_the_compose_prometheus_loads_the_rules() -> None:
    """deploy/prometheus.yml names the rule file relative to itself; docker-compose.yml mounts it at
    the same place beside /etc/prometheus/prometheus.yml, so the config works on the host (promtool)
    and in the container alike."""
    output = _promtool("check", "config", str(PROMETHEUS_CONFIG))
    assert "SUCCESS: 1 rule files found" in output, output
    listed = re.search(r"^rule_files:\s*\n((?:\s+-\s*\S+\s*\n)+)", PROMETHEUS_CONFIG.read_text(),
                       re.MULTILINE)
    assert listed, f"no rule_files in {PROMETHEUS_CONFIG}"
    files = re.findall(r"-\s*(\S+)", listed.group(1))
    assert files == ["prometheus/alerts.yml"], files
    assert (DEPLOY / files[0]).resolve() == RULES.resolve()
    compose = COMPOSE_FILE.read_text()
    assert f"- ./deploy/{files[0]}:/etc/prometheus/{files[0]}:ro" in compose, (
        f"docker-compose.yml does not mount deploy/{files[0]} at /etc/prometheus/{files[0]}")
