"""The recorder in a process of its own, with real processes: killed
mid-run, stopped, its engine killed, and a seal that returns at once.

The engine here is the fake one (``offload_fsm.testing``) driven at about a
real engine's pace, with the connector's hand-off (``connector.handoff``)
and the real recorder (``python -m connector.recorder``). The same path
under real vLLM is in ``tests/e2e``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from connector.handoff import Handoff
from connector.supervisor import launcher
from offload_fsm import Settings
from offload_fsm.log.decode import LogDecoder
from offload_fsm.log.framing import Record, scan
from offload_fsm.log.records import VANISHED, Gap
from offload_fsm.log.wire import unpackb
from offload_fsm.testing.synthetic import default_config, run_workload
from replay.reader import run_files
from replay.runner import replay

REPO = Path(__file__).resolve().parents[2]
END_WAIT_S = 30.0  # a recorder just started on a loaded box is still importing at the close


def spec(directory: Path, budget_bytes: int = 64 << 20) -> dict[str, Any]:
    return {"directory": str(directory), "prefix": "run", "engine_index": 0, "world_size": 2,
            "header_config": Settings(offload=default_config()).to_wire(),
            "versions": {"package": "test", "vllm": "", "lmcache": ""},
            "max_file_bytes": 1 << 20, "max_total_bytes": 1 << 30,
            "budget_bytes": budget_bytes, "digest_every": 200}


def handoff(directory: Path, warnings: list[str], budget_bytes: int = 64 << 20) -> Handoff:
    return Handoff(launcher(spec(directory, budget_bytes)), budget_bytes=budget_bytes,
                   digest_every=200, warn=warnings.append, liveness_every_s=0.02,
                   backoff_s=(0.05, 0.2), end_wait_s=END_WAIT_S, register_atexit=False)


def _gap_events(directory: Path) -> int:
    lost = 0
    for path in run_files(directory):
        decoder = LogDecoder()
        for item in scan(path.read_bytes()):
            if isinstance(item, Record):
                lost += sum(record.lost_count for record in decoder.decode_all(item.payload)
                            if isinstance(record, Gap))
    return lost


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pid: int, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.02)
    return False


def test_a_recorder_killed_mid_run_is_restarted_and_the_log_says_what_was_lost(
        tmp_path: Path) -> None:
    warnings: list[str] = []
    h = handoff(tmp_path, warnings)
    calls = [0]
    killed: list[int] = []

    def sink(applied: Any, state: Any) -> None:
        calls[0] += 1
        if calls[0] == 300:
            link = h._link
            assert link is not None
            killed.append(link.pid)  # type: ignore[attr-defined]
            os.kill(link.pid, signal.SIGKILL)  # type: ignore[attr-defined]
        h.record(applied, state)
        time.sleep(0.001)  # about an engine step's pace

    world = run_workload(requests=250, seed=5, sink=sink)
    h.close(world.state)
    assert h.wait_for_end()
    assert h.stats.recorder_restarts == 1
    assert len(warnings) == 1 and "exited (code -9)" in warnings[0]
    assert _wait_gone(killed[0])
    result = replay(tmp_path)
    assert result.divergence is None and result.rejection is None, result.divergence
    assert result.ended_cleanly and result.digests_checked >= 1
    assert result.lost and "lost by the writer" in result.lost[0]
    assert result.snapshots_loaded  # folding went on from the restarted recorder's snapshot
    # Every event is in the log or in a GAP (the recorder's: what the run's
    # files hold, not the engine's estimate of what was taken in).
    assert result.events_applied + _gap_events(tmp_path) == len(world.applied)


def test_a_stopped_recorder_costs_the_engine_at_most_its_budget(tmp_path: Path) -> None:
    warnings: list[str] = []
    budget = 64 * 1024
    h = handoff(tmp_path, warnings, budget_bytes=budget)
    link: Any = h._link
    calls = [0]

    def sink(applied: Any, state: Any) -> None:
        calls[0] += 1
        if calls[0] == 20:
            time.sleep(0.2)  # let the recorder start
            os.kill(link.pid, signal.SIGSTOP)
        if calls[0] == 2500:
            os.kill(link.pid, signal.SIGCONT)
        h.record(applied, state)
        if calls[0] > 2500:
            time.sleep(0.001)

    try:
        world = run_workload(requests=500, seed=6, sink=sink)
    finally:
        os.kill(link.pid, signal.SIGCONT)
    h.close(world.state)
    assert h.wait_for_end()
    assert calls[0] > 3000
    assert h.stats.bytes_in_flight_max <= budget
    assert h.stats.events_lost > 0 and h.stats.recorder_restarts == 0
    assert len(warnings) == 1 and "budget" in warnings[0]
    result = replay(tmp_path)
    assert result.divergence is None and result.ended_cleanly, result.divergence
    assert result.lost and result.snapshots_loaded
    assert result.events_applied + _gap_events(tmp_path) == len(world.applied)


def test_the_seal_returns_at_once_even_with_a_stopped_recorder(tmp_path: Path) -> None:
    h = handoff(tmp_path, [])
    link: Any = h._link
    world = run_workload(requests=40, seed=7, sink=h.record)
    time.sleep(0.2)
    os.kill(link.pid, signal.SIGSTOP)
    try:
        started = time.perf_counter()
        h.close(world.state)
        took_s = time.perf_counter() - started
    finally:
        os.kill(link.pid, signal.SIGCONT)
    assert took_s < 0.05
    assert h.wait_for_end()
    assert replay(tmp_path).ended_cleanly


def acknowledged(h: Handoff, timeout_s: float = 60.0) -> None:
    """Hand over what ``h`` holds and wait until its recorder acknowledged all
    of it (a recorder on a loaded box may still be starting)."""
    link = h._link
    assert link is not None
    link.flush()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        h._take_replies(link)
        if h.stats.bytes_in_flight == 0:
            return
        time.sleep(0.01)


_ENGINE = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {tests!r})
    from test_recorder_process import acknowledged, handoff
    from offload_fsm.testing.synthetic import run_workload
    from pathlib import Path
    h = handoff(Path({directory!r}), [])
    calls = [0]
    def sink(applied, state):
        calls[0] += 1
        h.record(applied, state)
        time.sleep(0.001)
        if calls[0] == 400:
            link = h._link
            print(link.pid, flush=True)
            acknowledged(h)
            os.kill(os.getpid(), signal.SIGKILL)
    run_workload(requests=400, seed=8, sink=sink)
""")


def test_an_engine_killed_leaves_a_closed_log_that_says_so(tmp_path: Path) -> None:
    """SIGKILL to the engine: its recorder writes what it received, ends the
    log with VANISHED, and exits; the log verifies up to there."""
    code = _ENGINE.format(tests=str(Path(__file__).parent), directory=str(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    engine = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=120, check=False)
    assert engine.returncode == -signal.SIGKILL, engine.stderr
    recorder_pid = int(engine.stdout.split()[0])
    assert _wait_gone(recorder_pid), "the recorder outlived its engine"
    (last,) = [item for item in scan(run_files(tmp_path)[-1].read_bytes())][-1:]
    assert isinstance(last, Record) and unpackb(last.payload)[0] == VANISHED
    result = replay(tmp_path)
    assert result.divergence is None and result.rejection is None and not result.damage
    assert "the engine vanished after event" in result.vanished
    assert result.events_applied >= 300


_ENGINE_BEHIND = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {tests!r})
    from test_recorder_process import acknowledged, handoff
    from offload_fsm.testing.synthetic import run_workload
    from pathlib import Path
    h = handoff(Path({directory!r}), [])
    calls = [0]
    def sink(applied, state):
        calls[0] += 1
        h.record(applied, state)
        if calls[0] == 200:
            link = h._link
            print(link.pid, flush=True)
            acknowledged(h)
            os.kill(link.pid, signal.SIGSTOP)  # then it falls behind
        if calls[0] == 300:
            h._link.flush()
            time.sleep(0.3)  # into the recorder's socket, unread
            os.kill(os.getpid(), signal.SIGKILL)
    run_workload(requests=400, seed=8, sink=sink)
""")


def test_a_recorder_behind_its_killed_engine_still_ends_the_log_and_exits(
        tmp_path: Path) -> None:
    """The engine dies while the recorder has messages it has not read: the
    recorder reads them, cannot acknowledge them (no engine), ends the log
    with VANISHED and exits rather than waiting for ever on the acknowledgement."""
    code = _ENGINE_BEHIND.format(tests=str(Path(__file__).parent), directory=str(tmp_path))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = tmp_path / "engine.out"
    with out.open("w") as stdout:  # a file: the stopped recorder inherits it, a pipe never ends
        engine = subprocess.Popen([sys.executable, "-c", code], stdout=stdout,
                                  stderr=subprocess.DEVNULL, env=env)
        returncode = engine.wait(timeout=120)
    assert returncode == -signal.SIGKILL, out.read_text()
    recorder_pid = int(out.read_text().split()[0])
    os.kill(recorder_pid, signal.SIGCONT)
    try:
        assert _wait_gone(recorder_pid), "the recorder outlived its engine"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(recorder_pid, signal.SIGKILL)
    (last,) = [item for item in scan(run_files(tmp_path)[-1].read_bytes())][-1:]
    assert isinstance(last, Record) and unpackb(last.payload)[0] == VANISHED
    result = replay(tmp_path)
    assert result.divergence is None and result.rejection is None and not result.damage
    assert result.events_applied > 0


def test_a_stream_that_cannot_bind_is_one_warning_and_a_counter(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    import zmq

    context = zmq.Context()
    taken = context.socket(zmq.PUB)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        settings = spec(tmp_path)
        settings["pub_endpoint"] = f"tcp://127.0.0.1:{port}"
        h = Handoff(launcher(settings), budget_bytes=64 << 20, warn=lambda m: None,
                    end_wait_s=END_WAIT_S, register_atexit=False)
        world = run_workload(requests=30, seed=9, sink=h.record)
        h.close(world.state)
        assert h.wait_for_end()
    finally:
        taken.close(linger=0)
        context.term()
    assert h.recorder_stats["pub_bind_failed"] == 1
    assert capfd.readouterr().err.count("the live stream cannot bind") == 1
    assert replay(tmp_path).ended_cleanly
