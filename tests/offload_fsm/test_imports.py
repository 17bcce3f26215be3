"""The core stays pure: no vLLM, torch, ZeroMQ or structlog at import time,
and its sources import only the standard library, attrs and msgpack."""

from __future__ import annotations

import ast
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import offload_fsm

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "offload_fsm"
FORBIDDEN = ("vllm", "torch", "zmq", "structlog")
ALLOWED_THIRD_PARTY = {"attrs", "msgpack"}


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


def test_package_is_the_source_tree() -> None:
    assert Path(offload_fsm.__file__).resolve().parent == PACKAGE
