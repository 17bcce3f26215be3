"""The soak's two faults, injected into the ``ours`` arm at fractions of its run.

Contract. :func:`restart_fault` SIGKILLs the LMCache server at a given monotonic time,
leaves it down ``outage_s`` and starts it again on the same ports; :func:`lost_receipt_env`
is the server environment that loses one store receipt inside the engine core
(``testkit.lose_one_receipt``, imported there through a ``sitecustomize.py`` in a
temporary directory on the server's ``PYTHONPATH``; never the product), and
:func:`lost_receipt_fault` waits for it to fire and for the product to book the batch
``StoreAbandoned`` once the lease has passed. Each returns what moved: the fault
counters just before and after (and their delta), and the server log's lines in the
window. Nothing here asserts; a fault that did not happen is reported as such.

Theory of operation. At ``--restart-at`` (0.3) the server is killed, left down
``--outage-s`` (10 s) and restarted; counters and log lines are taken just before and
:data:`AFTER_RESTART_S` after. From ``--lose-receipt-at`` (0.6) the hook drops the next
receipt; counters are taken 5 s before it is due and again once its note and the
product's ``store abandoned`` line are both there (at most lease + 120 s later).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.soak.engine import ANSI, delta, fault_counters, read_from, scrape, warning_kinds
from bench.trees import REPO
from testkit.lmcache_server import LMCacheServer
from testkit.lose_one_receipt import AFTER_ENV, NOTE_ENV, T0_ENV, write_sitecustomize

AFTER_RESTART_S = 60.0


def lost_receipt_env(after_s: float, t0_file: Path, note_path: Path) -> dict[str, str]:
    """The server's extra environment: the hook on its ``PYTHONPATH``, armed to lose one
    receipt ``after_s`` after the time written in ``t0_file``, its note to ``note_path``."""
    hook_dir = Path(tempfile.mkdtemp(prefix="soak-hook-"))
    write_sitecustomize(hook_dir)
    return {
        "PYTHONPATH": os.pathsep.join(
            [str(hook_dir), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
        AFTER_ENV: str(round(after_s, 1)),
        T0_ENV: f"@{t0_file}",
        NOTE_ENV: str(note_path),
    }


def lmcache_objects(server: LMCacheServer) -> int | None:
    """The server's object count, or None where it cannot tell (it is a figure)."""
    try:
        return server.object_count()
    except Exception:  # noqa: BLE001 - a figure, not a check
        return None


def _wait_until(deadline: float) -> None:
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(left, 1.0))


def restart_fault(server: LMCacheServer, port: int, log_path: Path, t0: float, at: float,
                  outage_s: float) -> dict[str, Any]:
    """SIGKILL the LMCache server at ``at``, restart it on the same ports after the
    outage; what moved between just before and ``AFTER_RESTART_S`` after."""
    _wait_until(at)
    objects_before = lmcache_objects(server)
    before = fault_counters(scrape(port))
    offset = log_path.stat().st_size
    killed_at = time.monotonic()
    server.kill()
    time.sleep(outage_s)
    server.restart()
    restarted_after_s = time.monotonic() - killed_at
    _wait_until(time.monotonic() + AFTER_RESTART_S)
    after = fault_counters(scrape(port))
    window = read_from(log_path, offset)
    kinds = warning_kinds(window)
    return {
        "killed_at_s": round(killed_at - t0, 1),
        "down_s": round(restarted_after_s, 1),
        "healthy_at_s": round(killed_at + restarted_after_s - t0, 1),
        "objects_before_kill": objects_before,
        "objects_60s_after_restart": lmcache_objects(server),
        "before": before, "after": after, "delta": delta(before, after),
        "window_s": round(time.monotonic() - killed_at, 1),
        "log_lines": {level: dict(c.most_common()) for level, c in kinds.items()},
        "store_failed_lines": [ANSI.sub("", line)[-300:] for line in window.splitlines()
                               if "lazy offload: store failed" in line][:20],
    }


def lost_receipt_fault(port: int, log_path: Path, note_path: Path, due: float,
                       lease_s: float) -> dict[str, Any]:
    """Counters just before the hook is due; then wait for its note and the
    product's ``store abandoned`` line (at most lease + 120 s); counters again."""
    _wait_until(due - 5.0)
    before = fault_counters(scrape(port))
    offset = log_path.stat().st_size
    deadline = due + lease_s + 120.0
    fired: dict[str, Any] | None = None
    abandoned: list[str] = []
    while time.monotonic() < deadline:
        if fired is None and note_path.exists() and note_path.read_text().strip():
            fired = json.loads(note_path.read_text().splitlines()[0])
        window = read_from(log_path, offset)
        abandoned = [ANSI.sub("", line) for line in window.splitlines()
                     if "lazy offload: store abandoned" in line]
        if fired is not None and abandoned:
            break
        time.sleep(1.0)
    time.sleep(5.0)
    after = fault_counters(scrape(port))
    fields: dict[str, str] = {}
    if abandoned:
        fields = dict(re.findall(r"(\w+)=(\S+)", abandoned[0]))
    return {
        "hook_fired": fired, "abandoned_lines": [line[-400:] for line in abandoned],
        "abandoned_fields": fields,
        "same_request": bool(fired and fields.get("req_id") == fired.get("req_id")),
        "before": before, "after": after, "delta": delta(before, after),
    }
