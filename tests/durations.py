"""How long each test module takes, so a parallel run hands out the longest groups first.

Why: pytest-xdist gives a worker a whole group (a module, or all of Spark's tests) and hands groups
out in the order the tests were collected. A 4-minute module that happens to start last leaves every
other worker idle for 4 minutes. Sorting groups by their measured length (longest processing time
first) keeps the tail short; the unit tests, a thousand tests of milliseconds, fill it.

The figures live in ``tests/durations.json`` (module path -> seconds, setup and teardown included).
A module missing from it counts as ``UNKNOWN_MODULE_S``. Refresh it after a run with a JUnit report:

    .venv/bin/pytest -n 3 --junitxml=run.xml ... && python -m tests.durations run.xml
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

DURATIONS = Path(__file__).resolve().parent / "durations.json"
_REPO = DURATIONS.parent.parent

#: Seconds assumed for a module with no figure yet (a typical integration module).
UNKNOWN_MODULE_S = 60.0
#: Where the ungrouped tests (the unit tests, spread one at a time) sort: after every group.
UNGROUPED_COST = -1.0


def load(path: Path = DURATIONS) -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError) as exc:
        raise RuntimeError(f"{path} is unreadable ({exc}): "
                           "regenerate it with python -m tests.durations") from exc


def group_costs(members: Iterable[tuple[str | None, str]]) -> dict[str | None, float]:
    """Seconds per group, from (group, module path) pairs: a group costs the modules it holds.

    A module split between two groups (some tests marked quiet) counts whole in each: an estimate
    only decides the order.
    """
    seconds = load()
    modules: dict[str | None, set[str]] = defaultdict(set)
    for group, module in members:
        modules[group].add(module)
    costs = {group: sum(seconds.get(m, UNKNOWN_MODULE_S) for m in held) for group, held in modules.items()}
    costs[None] = UNGROUPED_COST
    return costs


def from_junit(report: Path) -> dict[str, float]:
    """Module path -> seconds, summed over a JUnit XML report's test cases."""
    totals: dict[str, float] = defaultdict(float)
    for case in ET.parse(report).getroot().iter("testcase"):
        classname = case.get("classname", "")
        parts = classname.split(".")
        # "tests.integration.test_fleet" or "tests.integration.test_fleet.TestClass"
        while parts and not (_REPO / Path(*parts).with_suffix(".py")).exists():
            parts.pop()
        if parts:
            totals[Path(*parts).with_suffix(".py").as_posix()] += float(case.get("time", "0"))
    return {module: round(total, 1) for module, total in sorted(totals.items())}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.durations JUNIT.xml (run from the repository root)", file=sys.stderr)
        return 2
    figures = from_junit(Path(argv[0]))
    if not figures:
        print(f"{argv[0]}: no test cases whose module exists here", file=sys.stderr)
        return 1
    DURATIONS.write_text(json.dumps(figures, indent=1) + "\n")
    print(f"wrote {len(figures)} modules to {DURATIONS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
