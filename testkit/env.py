"""The environment vLLM and LMCache run under in tests, the demo and the benchmarks:
offline hub, a 1 GiB CPU KV cache, no usage tracking, no banner, stacks on a fatal signal.

Primitives:
  E2E_ENV            the variables and their values
  apply_e2e_env()    set each one in ``os.environ`` unless it is already set
  require_stack()    vLLM and LMCache importable, or skip (fail under ``CI=true``)
  require_program()  a program on ``PATH``, or skip (fail under ``CI=true``)

Contract: :func:`apply_e2e_env` must run before vLLM or LMCache is imported or spawns a
subprocess, since both read these variables at import time. A value already in the
environment wins, so a caller can override any of them.
"""

from __future__ import annotations

import os

E2E_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "DO_NOT_TRACK": "1",
    "LMCACHE_TRACK_USAGE": "false",
    "VLLM_NO_USAGE_STATS": "1",
    "LMCACHE_DISABLE_BANNER": "1",
    # A process that dies of SIGABRT, SIGSEGV and the like writes its threads' stacks
    # to stderr first (``testkit.engine.shutdown`` aborts an engine stuck in teardown).
    "PYTHONFAULTHANDLER": "1",
}


def apply_e2e_env() -> None:
    """``os.environ.setdefault`` for every entry of :data:`E2E_ENV`."""
    for key, value in E2E_ENV.items():
        os.environ.setdefault(key, value)


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


def require_stack() -> None:
    """For a test module that needs vLLM and LMCache importable: skip it when
    they are missing, but fail under ``CI=true`` (CI must never pass by
    skipping)."""
    import importlib

    import pytest

    apply_e2e_env()
    for module in ("vllm", "lmcache"):
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - any import failure counts
            message = f"`import {module}` failed: {type(exc).__name__}: {exc}"
            if in_ci():
                pytest.fail(f"CI=true and {message}", pytrace=False)
            pytest.skip(message, allow_module_level=True)


def require_program(*names: str, install: str) -> str:
    """The path of the first of ``names`` on ``PATH``, for a test that runs that
    program: skip without one, but fail under ``CI=true``; ``install`` says how
    to get it."""
    import shutil

    import pytest

    for name in names:
        path = shutil.which(name)
        if path is not None:
            return path
    message = f"none of {', '.join(names)} is on PATH ({install})"
    if in_ci():
        pytest.fail(f"CI=true and {message}", pytrace=False)
    pytest.skip(message)
