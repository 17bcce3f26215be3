"""A fault for the soak (``bench.soak``): one store receipt lost, inside vLLM's
engine-core process, never in the product.

vLLM's OpenAI server runs the scheduler (and so our connector's manager) in a
child process, out of reach of the harness. :func:`write_sitecustomize` writes a
``sitecustomize.py`` into a directory the harness creates at run time; put that
directory (and the repository root) on the server's ``PYTHONPATH`` and every
Python process under it runs :func:`install` at start-up. With
``LAZY_OFFLOAD_SOAK_LOSE_RECEIPT_AFTER_S`` unset that is a no-op.

With it set, :func:`install` adds an import hook that, once
``connector.shell.manager`` is imported, wraps
``EventSourcedManager.on_store_results``: the first call at or after
``T0 + AFTER_S`` (wall clock; ``T0`` is ``LAZY_OFFLOAD_SOAK_LOSE_RECEIPT_T0``
in epoch seconds, or ``@PATH``: the epoch seconds written into PATH later, the
harness's traffic start, and nothing is due before that file exists; default:
when this process installed the hook) that carries a
completion for a request not also reported failed loses that request's
completion count (the call gets a copy of the dict without it). Once per
process, then never again. It says so on stderr (which vLLM's server log
captures) as one line starting with :data:`FIRED`, and appends the same as a
JSON line to ``LAZY_OFFLOAD_SOAK_LOSE_RECEIPT_NOTE`` when that is set.

The product should then book that batch ``StoreAbandoned`` once
``lmcache.mp.lazy_offload_receipt_lease_s`` has passed (its log line ``lazy
offload: store abandoned …``, ``abandoned_batches_total`` on ``/metrics``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

AFTER_ENV = "LAZY_OFFLOAD_SOAK_LOSE_RECEIPT_AFTER_S"
T0_ENV = "LAZY_OFFLOAD_SOAK_LOSE_RECEIPT_T0"
NOTE_ENV = "LAZY_OFFLOAD_SOAK_LOSE_RECEIPT_NOTE"
TARGET = "connector.shell.manager"
FIRED = "lose_one_receipt: dropped a store receipt"

SITECUSTOMIZE = """\
# Written by testkit.lose_one_receipt.write_sitecustomize for a soak run.
import os
if os.environ.get({after!r}):
    try:
        import testkit.lose_one_receipt as _lose_one_receipt
        _lose_one_receipt.install()
    except Exception as _error:  # never stop a process from starting
        import sys
        print(f"lose_one_receipt: not installed: {{_error!r}}", file=sys.stderr, flush=True)
"""


def write_sitecustomize(directory: Path) -> Path:
    """``directory/sitecustomize.py`` that installs the hook when the env var is set."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "sitecustomize.py"
    path.write_text(SITECUSTOMIZE.format(after=AFTER_ENV))
    return path


def install() -> None:
    """Patch ``connector.shell.manager`` now if it is imported, else when it is."""
    due = _Due(float(os.environ[AFTER_ENV]), os.environ.get(T0_ENV) or str(time.time()))
    module = sys.modules.get(TARGET)
    if module is not None:
        _patch(module, due)
        return
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder(due))


class _Due:
    """When the receipt is to be lost: ``t0 + after_s``, ``t0`` maybe read later
    from a file (``@PATH``)."""

    def __init__(self, after_s: float, t0: str) -> None:
        self.after_s = after_s
        self._t0_file = t0[1:] if t0.startswith("@") else None
        self.at: float | None = None if self._t0_file else float(t0) + after_s

    def reached(self, now: float) -> bool:
        if self.at is None:
            try:
                self.at = float(Path(self._t0_file or "").read_text()) + self.after_s
            except (OSError, ValueError):
                return False
        return now >= self.at


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, due: _Due) -> None:
        self._due = due

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = loader.exec_module
        due = self._due

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            _patch(module, due)

        loader.exec_module = exec_and_patch
        return spec


def _patch(module: Any, due: _Due) -> None:
    cls = module.EventSourcedManager
    if getattr(cls.on_store_results, "_lose_one_receipt", False):
        return
    original = cls.on_store_results
    fired = False

    def on_store_results(self: Any, failed_request_ids: set[str],
                         completed_store_counts: dict[str, int]) -> Any:
        nonlocal fired
        if not fired and completed_store_counts and due.reached(time.time()):
            candidates = sorted(r for r in completed_store_counts if r not in failed_request_ids)
            if candidates:
                fired = True
                req_id = candidates[0]
                counts = dict(completed_store_counts)
                lost = counts.pop(req_id)
                completed_store_counts = counts
                _report(self, req_id, lost, due)
        return original(self, failed_request_ids, completed_store_counts)

    on_store_results._lose_one_receipt = True  # type: ignore[attr-defined]
    cls.on_store_results = on_store_results


def _report(manager: Any, req_id: str, lost: int, due: _Due) -> None:
    submitted = getattr(manager, "_submitted", {}).get(req_id)
    batch_id, blocks = (submitted[0], len(submitted[1])) if submitted else (None, None)
    now = time.time()
    note = {"pid": os.getpid(), "time": now, "late_s": round(now - (due.at or now), 3),
            "req_id": req_id, "completions_lost": lost, "batch_id": batch_id,
            "blocks": blocks}
    print(f"{FIRED} req_id={req_id} batch_id={batch_id} blocks={blocks} "
          f"completions_lost={lost} pid={os.getpid()}", file=sys.stderr, flush=True)
    path = os.environ.get(NOTE_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(note) + "\n")
