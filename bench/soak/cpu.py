"""Where a soak arm's CPU goes: seconds of CPU by process, and by thread inside the
engine core, between two readings.

Contract. :func:`reading` reads, from ``/proc``, the user + system CPU seconds so far
of every process of one arm: the API server, its engine core, the engine core's
workers, every other descendant of the API server, the recorder (which left the
engine's tree) and the arm's LMCache server; and of each engine-core thread, by
thread name (``comm``; threads of one name are summed). :func:`spent` is the
difference of two readings: what the arm used between them (a process or thread
that appeared in between counts from zero; one that exited in between is not
counted). Read-only: it never signals or changes a process.

Why. On a 2-core CPU engine the model's torch threads want both cores, so every
CPU second another process or thread of the arm takes (the connector's pass, the
recorder, ZeroMQ's I/O threads, LMCache's client and server) is a second the
forward waits for; a connector that adds little to the scheduler's step can still
slow requests down this way. The seconds per request, arm beside arm, say which
part of the stack pays.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import Any

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _cpu_s(stat_path: Path) -> float | None:
    """utime + stime of one ``/proc/.../stat`` in seconds; None if it is gone."""
    try:
        fields = stat_path.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S  # fields 14, 15 of stat


def _threads_cpu_s(pid: int) -> dict[str, float]:
    by_name: defaultdict[str, float] = defaultdict(float)
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return {}
    for task in tasks:
        try:
            name = (task / "comm").read_text().strip()
        except OSError:
            continue
        seconds = _cpu_s(task / "stat")
        if seconds is not None:
            by_name[name] += seconds
    return dict(by_name)


def reading(procs: dict[str, Any], lmcache_pid: int | None) -> dict[str, Any]:
    """CPU seconds so far by role (``api``, ``engine``, ``workers``, ``other``,
    ``recorder``, ``lmcache``: the server and its descendants) and by engine-core
    thread name. ``procs``: the pids by role as ``bench.soak.engine.processes``
    finds them."""
    import psutil

    roles: defaultdict[str, float] = defaultdict(float)
    api, engine = procs.get("api"), procs.get("engine")
    descendants: list[Any] = []
    if api is not None:
        try:
            descendants = psutil.Process(api).children(recursive=True)
        except psutil.Error:
            descendants = []
    engine_children: set[int] = set()
    if engine is not None:
        try:
            engine_children = {p.pid for p in psutil.Process(engine).children(recursive=True)}
        except psutil.Error:
            engine_children = set()
    for pid, role in ((api, "api"), (engine, "engine"), (procs.get("recorder"), "recorder")):
        if pid is not None:
            roles[role] += _cpu_s(Path(f"/proc/{pid}/stat")) or 0.0
    if lmcache_pid is not None:
        try:
            server = [lmcache_pid, *(p.pid for p in psutil.Process(lmcache_pid).children(
                recursive=True))]
        except psutil.Error:
            server = []
        for pid in server:
            roles["lmcache"] += _cpu_s(Path(f"/proc/{pid}/stat")) or 0.0
    for proc in descendants:
        if proc.pid in (engine, procs.get("recorder")):
            continue
        role = "workers" if proc.pid in engine_children else "other"
        roles[role] += _cpu_s(Path(f"/proc/{proc.pid}/stat")) or 0.0
    threads = _threads_cpu_s(engine) if engine is not None else {}
    return {"roles": dict(roles), "engine_threads": dict(threads)}


def spent(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What was used between two :func:`reading` s, by role and by engine thread."""
    out: dict[str, Any] = {}
    for key in ("roles", "engine_threads"):
        old, new = before.get(key, {}), after.get(key, {})
        out[key] = {name: round(max(new[name] - old.get(name, 0.0), 0.0), 2) for name in new}
    return out
