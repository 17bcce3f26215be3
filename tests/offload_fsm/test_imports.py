"""The dependency direction holds.

* The core's packages keep their layer order (``LAYERS``): vocabulary, then
  the state, then the rules, then the policies, then the machine; the log
  reads the vocabulary and the state, never the machine.
* No import circle anywhere in the project.
* The core stays pure: no vLLM, torch, ZeroMQ or structlog at import time, and
  its sources (``offload_fsm`` less its ``testing`` subpackage) import only the
  standard library, attrs and msgpack: nothing of ours outside the core.
* ``replay`` never imports ``connector``.
* Nothing outside ``tests/`` imports ``tests``, by an import statement or by a
  module path in a string (``python -m tests.x``, ``kv_connector_module_path``).

Source rules are checked on the AST, so an import inside a function counts too.
"""

from __future__ import annotations

import ast
import json
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import offload_fsm

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "offload_fsm"
FORBIDDEN = ("vllm", "torch", "zmq", "structlog")
ALLOWED_THIRD_PARTY = {"attrs", "msgpack"}
OURS = ("offload_fsm", "logfiles", "connector", "replay", "testkit", "tests", "bench", "demo")
OUTSIDE_TESTS = ("offload_fsm", "logfiles", "connector", "replay", "testkit", "bench", "demo",
                 "scripts")
_MODULE_PATH = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")


def core_modules() -> list[str]:
    return sorted(
        info.name
        for info in pkgutil.walk_packages([str(PACKAGE)], prefix="offload_fsm.")
        if info.name.split(".")[1] != "testing"
    )


def core_sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "testing" not in p.relative_to(PACKAGE).parts)


def test_core_modules_are_found() -> None:
    names = core_modules()
    for expected in ("machine", "policies.registry", "vocabulary.events", "rules.drain",
                     "state", "invariants", "digest", "log.wire", "log.records"):
        assert f"offload_fsm.{expected}" in names


# Each unit of the core (a top-level module or a package) and the units it may
# import: only those below it. Its own package's modules it may always import.
LAYERS: dict[str, frozenset[str]] = {
    "vocabulary": frozenset(),
    "state": frozenset({"vocabulary"}),
    "digest": frozenset({"vocabulary", "state"}),
    "invariants": frozenset({"vocabulary", "state"}),
    "after_failure": frozenset({"vocabulary", "state"}),
    "log": frozenset({"vocabulary", "state"}),
    "rules": frozenset({"vocabulary", "state"}),
    "policies": frozenset({"vocabulary", "state", "rules"}),
    "queries": frozenset({"vocabulary", "state", "rules", "policies"}),
    "machine": frozenset({"vocabulary", "state", "rules", "policies", "queries"}),
    "refold": frozenset({"vocabulary", "state", "log", "machine"}),
}


def _core_units_imported(path: Path) -> set[str]:
    """The core units (``LAYERS``' keys) that ``path`` imports."""
    units = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        modules = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module] if node.module != "offload_fsm" else [
                f"offload_fsm.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        for module in modules:
            parts = module.split(".")
            if parts[0] == "offload_fsm" and len(parts) > 1 and parts[1] in LAYERS:
                units.add(parts[1])
    return units


def test_every_core_unit_has_a_layer() -> None:
    units = {path.relative_to(PACKAGE).parts[0].removesuffix(".py") for path in core_sources()}
    assert units - {"__init__"} == set(LAYERS)


@pytest.mark.parametrize("path", core_sources(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_the_core_keeps_its_layer_order(path: Path) -> None:
    unit = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
    if unit == "__init__":
        return
    assert _core_units_imported(path) - {unit} <= LAYERS[unit]


def test_the_layer_rule_sees_an_upward_import(tmp_path: Path) -> None:
    source = tmp_path / "sample.py"
    source.write_text("from offload_fsm import machine\n"
                      "def later():\n"
                      "    from offload_fsm.rules.drain import on_step\n")
    assert _core_units_imported(source) == {"machine", "rules"}


def _project_import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (at any depth of its code)."""
    modules = {}
    for top in OURS:
        for path in (REPO / top).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{alias.name}" for alias in node.names]
                targets.append(node.module)
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            for target in targets:
                if target in modules and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_anywhere() -> None:
    """A package's ``__init__`` that re-exports its modules is left out: a
    module importing a sibling through the package face is not a circle."""
    graph = _project_import_graph()
    faces = {name for name in graph if (REPO / name.replace(".", "/") / "__init__.py").exists()}
    graph = {name: edges - faces for name, edges in graph.items() if name not in faces}
    assert _circles(graph) == []


def test_the_circle_finder_sees_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_importing_the_core_loads_no_heavy_dependency() -> None:
    script = (
        "import importlib, json, sys\n"
        "import offload_fsm\n"
        f"for name in {core_modules()!r}:\n"
        "    importlib.import_module(name)\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r})))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
        check=False, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def _top_level_imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: inside the package
                continue
            assert node.module is not None
            found.append((node.lineno, node.module.split(".")[0]))
    return found


def _module_path_strings(path: Path) -> list[tuple[int, str]]:
    """String constants that are a dotted module path, as ``(line, top-level name)``."""
    return [
        (node.lineno, node.value.split(".")[0])
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path)))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        and _MODULE_PATH.fullmatch(node.value)
    ]


def _sources(*top_levels: str) -> list[Path]:
    return sorted(path for name in top_levels for path in (REPO / name).rglob("*.py"))


def _offenders(
    paths: list[Path], forbidden: set[str], *, module_path_strings: bool = False
) -> list[str]:
    return [
        f"{path.relative_to(REPO)}:{line}: {module}"
        for path in paths
        for line, module in _top_level_imports(path)
        + (_module_path_strings(path) if module_path_strings else [])
        if module in forbidden
    ]


def test_core_sources_import_only_stdlib_attrs_and_msgpack() -> None:
    allowed = set(sys.stdlib_module_names) | ALLOWED_THIRD_PARTY | {"offload_fsm"}
    offenders = [
        f"{path.relative_to(REPO)}:{line}: {module}"
        for path in core_sources()
        for line, module in _top_level_imports(path)
        if module not in allowed
    ]
    assert core_sources()
    assert offenders == []


def test_core_sources_import_nothing_of_ours_and_no_heavy_dependency() -> None:
    forbidden = (set(OURS) - {"offload_fsm"}) | set(FORBIDDEN)
    assert _offenders(core_sources(), forbidden) == []


def test_replay_never_imports_the_connector() -> None:
    sources = _sources("replay")
    assert sources
    assert _offenders(sources, {"connector"}) == []


@pytest.mark.parametrize("top_level", OUTSIDE_TESTS)
def test_nothing_outside_tests_imports_tests(top_level: str) -> None:
    assert _offenders(_sources(top_level), {"tests"}, module_path_strings=True) == []


def test_the_rules_see_what_they_forbid(tmp_path: Path) -> None:
    source = tmp_path / "sample.py"
    source.write_text(
        "import connector.blocks\n"
        "def later():\n"
        "    from tests.e2e import conftest\n"
        "    return ['-m', 'tests.e2e.helper', 'see tests.e2e for more']\n"
    )
    assert _top_level_imports(source) == [(1, "connector"), (3, "tests")]
    assert _module_path_strings(source) == [(4, "tests")]


def test_package_is_the_source_tree() -> None:
    assert Path(offload_fsm.__file__).resolve().parent == PACKAGE
