"""The folder tree tells the architecture (docs/architecture.md), and these checks keep it so.

- No import circles between the project's modules: two modules that need each other share a third.
  Every import counts, also those under TYPE_CHECKING and inside functions, since a circle there is
  still two modules that cannot be understood apart.
- The pure floor (`protocol/`, `quotas/`) imports only the standard library and kafka-python (and
  `cryptography` for the certificate subject), never a package above it.
- `proxy/` holds only the runtime's own modules; every other concern is a sub-package.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("protocol", "quotas", "config", "proxy", "cli", "top", "harness", "reports", "bench",
            "spark_tests", "tests")

#: The runtime's own modules, directly in proxy/: listeners and their accept loops, one client
#: connection, its ordered writer, TLS contexts, and the narrow interface between listeners and sessions.
PROXY_RUNTIME = {"__init__", "server", "acceptor", "session", "session_context", "ordered_writer", "tls"}
PROXY_SUBPACKAGES = {"admin", "capacity", "client_address", "fleet", "limits", "observability",
                     "supervisor", "upstream"}

#: What the pure packages may import besides each other and the standard library.
PURE_ALLOWED = {"kafka", "cryptography"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            found[_module_name(path)] = path
    return found


def _imports(name: str, path: Path) -> Iterator[str]:
    """Every module name an import statement in `path` may load (relative imports resolved)."""
    base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - (node.level - 1)]
                module = ".".join([*anchor, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            yield module
            for alias in node.names:
                yield f"{module}.{alias.name}"


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: {dep for dep in _imports(name, path) if dep in modules and dep != name}
            for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = iter(range(sys.maxsize))

    def visit(node: str) -> None:
        index[node] = low[node] = next(counter)
        stack.append(node)
        on_stack.add(node)
        for dep in sorted(graph[node]):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_cycle_finder_finds_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles() -> None:
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 10_000))
    try:
        circles = _cycles(_graph())
    finally:
        sys.setrecursionlimit(old)
    assert circles == [], "import circles (move what both need into a third module): " + "; ".join(
        " <-> ".join(circle) for circle in circles)


@pytest.mark.parametrize("package", ["protocol", "quotas"])
def test_pure_packages_import_only_the_floor(package: str) -> None:
    stdlib = set(sys.stdlib_module_names)
    own = {package, "protocol"} if package == "protocol" else {package, "protocol", "quotas"}
    offenders = []
    for path in (REPO / package).rglob("*.py"):
        for dep in _imports(_module_name(path), path):
            top = dep.split(".")[0]
            if top and top not in stdlib and top not in PURE_ALLOWED and top not in own:
                offenders.append(f"{path.relative_to(REPO)} imports {dep}")
    assert offenders == []


def test_proxy_holds_the_runtime_and_one_sub_package_per_concern() -> None:
    proxy = REPO / "proxy"
    loose = {path.stem for path in proxy.glob("*.py")} - PROXY_RUNTIME
    assert loose == set(), f"modules loose in proxy/ (put each in the sub-package of its concern): {loose}"
    packages = {path.parent.name for path in proxy.glob("*/__init__.py")}
    assert packages == PROXY_SUBPACKAGES, "update docs/architecture.md and this test together"
    architecture = (REPO / "docs" / "architecture.md").read_text()
    for package in sorted(packages):
        assert f"{package}/" in architecture, f"docs/architecture.md does not describe proxy/{package}/"


def test_every_runtime_package_is_installed() -> None:
    """pyproject.toml lists packages by hand: a new sub-package left out of it is missing from an
    installed copy (`pip install .`, the Docker image), which then fails to start."""
    import tomllib

    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(REPO).parts)
             for top in ("protocol", "quotas", "config", "proxy", "cli", "top", "harness", "reports")
             for init in (REPO / top).rglob("__init__.py")}
    assert found <= listed, f"not in pyproject.toml's packages: {sorted(found - listed)}"
