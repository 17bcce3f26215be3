"""The dependency direction holds.

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
OURS = ("offload_fsm", "connector", "replay", "testkit", "tests", "bench", "demo")
OUTSIDE_TESTS = ("offload_fsm", "connector", "replay", "testkit", "bench", "demo", "scripts")
_MODULE_PATH = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")


def core_modules() -> list[str]:
    return sorted(
        f"offload_fsm.{info.name}"
        for info in pkgutil.iter_modules([str(PACKAGE)])
        if info.name != "testing"
    )


def core_sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "testing" not in p.relative_to(PACKAGE).parts)


def test_core_modules_are_found() -> None:
    names = core_modules()
    for expected in ("machine", "policies", "events", "decisions", "commands", "state",
                     "invariants", "config", "codec", "errors"):
        assert f"offload_fsm.{expected}" in names


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
