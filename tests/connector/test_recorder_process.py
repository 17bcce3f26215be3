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
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from connector.handoff.sender import Handoff
from connector.handoff.supervisor import launcher
from connector.recorder.process import EXIT_FAILED
from logfiles.runs import run_files
from offload_fsm import Settings, drive, new_state
from offload_fsm.log.decode import LogDecoder
from offload_fsm.log.framing import Record, scan
from offload_fsm.log.records import VANISHED, Gap
from offload_fsm.log.wire import unpackb
from offload_fsm.testing.synthetic import default_config, run_workload
from offload_fsm.vocabulary.config import LOG_BUDGET_MIN_MIB
from offload_fsm.vocabulary.events import StepScheduled
from replay.runner import replay

REPO = Path(__file__).resolve().parents[2]
END_WAIT_S = 30.0  # a recorder just started on a loaded box is still importing at the close


def spec(directory: Path, budget_bytes: int = 64 << 20) -> dict[str, Any]:
    """The recorder's settings; its writer's queue gets the budget, at least
    the floor the configuration keeps (the engine's side may get less here)."""
    writer_bytes = max(budget_bytes, int(LOG_BUDGET_MIN_MIB * (1 << 20)))
    return {"directory": str(directory), "prefix": "run", "engine_index": 0, "world_size": 2,
            "header_config": Settings(offload=default_config()).to_wire(),
            "versions": {"package": "test", "vllm": "", "lmcache": ""},
            "max_file_bytes": 1 << 20, "max_total_bytes": 1 << 30,
            "budget_bytes": writer_bytes, "digest_every": 200}


def handoff(directory: Path, warnings: list[str], budget_bytes: int = 64 << 20) -> Handoff:
    launch = launcher(spec(directory, budget_bytes))
    return Handoff(launch, budget_bytes=budget_bytes,
                   digest_every=200, warn=warnings.append, liveness_every_s=0.02,
                   backoff_s=(0.05, 0.2), end_wait_s=END_WAIT_S, register_atexit=False,
                   release=launch.remove)


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
    assert len(warnings) == 1 and "the recorder process was killed" in warnings[0]
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
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with h._lock:  # the socket is the I/O thread's too
            h._flush(link)
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
            acknowledged(h)
            print(link.pid, flush=True)
            {then}
    run_workload(requests=400, seed=8, sink=sink)
""")


def _ends_with_vanished(directory: Path) -> Any:
    """The run in ``directory`` ends with VANISHED and replays clean to it."""
    (last,) = [item for item in scan(run_files(directory)[-1].read_bytes())][-1:]
    assert isinstance(last, Record) and unpackb(last.payload)[0] == VANISHED
    result = replay(directory)
    assert result.divergence is None and result.rejection is None and not result.damage
    assert "the engine vanished after event" in result.vanished
    return result


def test_an_engine_killed_leaves_a_closed_log_that_says_so(tmp_path: Path) -> None:
    """SIGKILL to the engine: its recorder writes what it received, ends the
    log with VANISHED, and exits; the log verifies up to there."""
    code = _ENGINE.format(tests=str(Path(__file__).parent), directory=str(tmp_path),
                          then="os.kill(os.getpid(), signal.SIGKILL)")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    engine = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=120, check=False)
    assert engine.returncode == -signal.SIGKILL, engine.stderr
    recorder_pid = int(engine.stdout.split()[0])
    assert _wait_gone(recorder_pid), "the recorder outlived its engine"
    assert _ends_with_vanished(tmp_path).events_applied >= 300


def test_vllms_kill_of_the_engines_process_tree_leaves_the_recorder_to_close_the_log(
        tmp_path: Path) -> None:
    """vLLM gives up on an engine core with ``kill_process_tree`` (every
    descendant SIGKILLed, at once under ``--shutdown-timeout 0``): the
    recorder is not among them (``connector.recorder.detach``), so it sees
    its engine gone, ends the log with VANISHED and exits."""
    from vllm.utils.system_utils import kill_process_tree

    code = _ENGINE.format(tests=str(Path(__file__).parent), directory=str(tmp_path),
                          then="time.sleep(120)  # until vLLM kills this engine's process tree")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    engine = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env=env)
    try:
        assert engine.stdout is not None
        recorder_pid = int(engine.stdout.readline())
        kill_process_tree(engine.pid)
        assert engine.wait(timeout=30) == -signal.SIGKILL
    finally:
        engine.kill()
    assert _wait_gone(recorder_pid), "the recorder outlived its engine"
    _ends_with_vanished(tmp_path)


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
            time.sleep(0.3)  # the I/O thread's turns hand it over: in the socket, unread
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


# --------------------------------------------------------------------------
# Issue 38: the hand-off's true bound, start-up faults, the import path.


def _idle_step(state: Any, i: int) -> Any:
    """One empty scheduler step: a 37-byte STEP message."""
    event = StepScheduled(scheduled_tokens=0, allocated_blocks=0, next_step_blocks=0,
                          reserve_blocks=0, free_blocks=100, window_block_ids=(),
                          reallocated=(), time_s=float(i))
    return drive(state, event, lambda command: None)


def test_a_stopped_recorder_and_tiny_steps_hold_no_more_than_the_budget(
        tmp_path: Path) -> None:
    """A stopped recorder, and a step per frame of 37 bytes (an idle or
    decoding engine): what the engine holds for the log, its bookkeeping
    (measured with tracemalloc) and the bytes in ZeroMQ's hands, stays within
    the budget, and the budget's count covers what was measured."""
    budget = 256 * 1024
    warnings: list[str] = []
    h = Handoff(launcher(spec(tmp_path, budget)), budget_bytes=budget, warn=warnings.append,
                flush_every_s=0.0, end_wait_s=END_WAIT_S, register_atexit=False,
                io_thread=False)
    acknowledged(h)
    link: Any = h._link
    state = new_state(default_config(), world_size=2)
    os.kill(link.pid, signal.SIGSTOP)
    try:
        for i in range(200):  # warm up: the deque's blocks, the ints' caches
            h.record(_idle_step(state, i), state)
        tracemalloc.start()
        try:
            before = tracemalloc.take_snapshot()
            for i in range(200, 20_000):
                h.record(_idle_step(state, i), state)
            after = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
    finally:
        os.kill(link.pid, signal.SIGCONT)
    ours = [tracemalloc.Filter(True, f"*connector/{name}") for name in
            ("handoff.py", "supervisor.py")]
    grown = sum(stat.size_diff for stat in after.filter_traces(ours).compare_to(
        before.filter_traces(ours), "filename"))
    in_zeromq = h._flight.sent - h._flight.acked  # ZeroMQ's copies of the frames, not traced
    assert h.events_lost > 10_000  # the budget filled: an outage
    assert grown + in_zeromq <= budget, (grown, in_zeromq)
    assert h.held_bytes >= grown + in_zeromq and h.stats.bytes_in_flight_max <= budget
    h.close(state)
    assert h.wait_for_end()


def _kill(h: Handoff) -> int:
    link: Any = h._link
    os.kill(link.pid, signal.SIGKILL)
    assert _wait_gone(link.pid)
    return int(link.pid)


def _run_until(h: Handoff, done: Any, seed: int, requests: int = 300,
               sink: Any = None) -> Any:
    """A workload at about an engine's pace until ``done()``, at full speed after."""
    def paced(applied: Any, state: Any) -> None:
        (sink or h.record)(applied, state)
        if not done():
            time.sleep(0.002)

    return run_workload(requests=requests, seed=seed, sink=paced)


def _back_up(h: Handoff) -> bool:
    return h.stats.recorder_restarts >= 1 and h.recorder_up


def test_a_log_directory_deleted_under_the_engine_is_made_again(tmp_path: Path) -> None:
    """The log directory removed (a tmp cleaner) and the recorder killed:
    the next recorder makes the directory again and the log resumes there,
    with one restart, not a recorder dying on every start."""
    logs = tmp_path / "logs"
    warnings: list[str] = []
    h = handoff(logs, warnings)
    world = run_workload(requests=20, seed=11, sink=h.record)
    acknowledged(h)
    shutil.rmtree(logs)
    _kill(h)
    world = _run_until(h, lambda: _back_up(h), seed=12)
    h.close(world.state)
    assert h.wait_for_end()
    assert h.stats.recorder_restarts == 1, warnings
    assert len(warnings) == 1 and "the recorder process was killed" in warnings[0]
    result = replay(logs)
    assert result.ended_cleanly and result.snapshots_loaded and result.divergence is None


def test_a_runtime_directory_removed_under_the_engine_is_made_again(tmp_path: Path) -> None:
    """The sockets' directory removed (a logout, a tmp cleaner) and the
    recorder killed: the next recorder still binds its socket."""
    warnings: list[str] = []
    h = handoff(tmp_path, warnings)
    run_workload(requests=20, seed=13, sink=h.record)
    acknowledged(h)
    link: Any = h._link
    shutil.rmtree(link.endpoint_path.parent)
    _kill(h)
    world = _run_until(h, lambda: _back_up(h), seed=14)
    h.close(world.state)
    assert h.wait_for_end()
    assert h.stats.recorder_restarts == 1, warnings
    assert replay(tmp_path).ended_cleanly


def test_a_log_directory_that_cannot_be_written_is_one_warning_with_the_fix(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """The log directory replaced by a file under a running engine: each new
    recorder sends FAILED (the cause, the fix) and exits with
    ``EXIT_FAILED``, no traceback; the engine says it once and starts
    recorders with its backoff."""
    logs = tmp_path / "logs"
    warnings: list[str] = []
    h = handoff(logs, warnings)
    run_workload(requests=20, seed=15, sink=h.record)
    acknowledged(h)
    shutil.rmtree(logs)
    logs.write_bytes(b"not a directory")
    codes: list[int | None] = []
    died = h._died

    def noted(link: Any, code: int, now: float) -> None:  # on whichever thread saw it
        codes.append(code)
        died(link, code, now)

    h._died = noted  # type: ignore[method-assign]
    _kill(h)
    world = _run_until(h, lambda: h.stats.recorder_restarts >= 3, seed=16, sink=h.record)
    h.close(world.state)
    cannot = [w for w in warnings if "cannot be written" in w]
    assert len(cannot) == 1, warnings
    assert f"the log directory {logs} cannot be written" in cannot[0]
    assert "lmcache.mp.lazy_offload_log_dir" in cannot[0]
    assert codes.count(EXIT_FAILED) >= 2 and h.stats.recorder_restarts >= 3
    assert "Traceback" not in capfd.readouterr().err


def test_the_recorder_imports_nothing_from_the_engines_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``json.py`` planted in the engine's working directory (which
    ``python -m`` would put first on the path) is never imported by the
    recorder, which still records."""
    planted = tmp_path / "cwd"
    planted.mkdir()
    marker = tmp_path / "imported"
    (planted / "json.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.chdir(planted)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(("", str(REPO))))  # "" too: the cwd
    h = handoff(tmp_path / "logs", [])
    world = run_workload(requests=20, seed=17, sink=h.record)
    h.close(world.state)
    assert h.wait_for_end()
    assert not marker.exists(), "the recorder imported the planted json.py"
    assert replay(tmp_path / "logs").ended_cleanly


_PEER = textwrap.dedent("""
    import sys, time, zmq
    peer = zmq.Context().socket(zmq.XSUB)
    peer.connect(sys.argv[1])
    peer.send(b"\\x01" + b"x" * (1 << 20))  # a 1 MiB subscription
    time.sleep(120)
""")


def test_a_peer_declaring_a_huge_subscription_is_cut_off(tmp_path: Path) -> None:
    """What a stream's peer (another process) may send the PUB is capped (a
    subscription is a few bytes): one sending a 1 MiB subscription is
    disconnected, not buffered."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    from connector.recorder.stream import pub_socket

    context = zmq.Context()
    endpoint = f"ipc://{tmp_path}/pub.sock"
    pub = pub_socket(context, endpoint, 1 << 20)
    monitor = pub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    peer = subprocess.Popen([sys.executable, "-c", _PEER, endpoint])
    try:
        assert monitor.poll(10_000), "the peer's 1 MiB subscription was taken in"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
    finally:
        peer.kill()  # killed: its libzmq crashes terminating a refused big message
        peer.wait(timeout=30)
        pub.disable_monitor()
        monitor.close(linger=0)
        pub.close(linger=0)
        context.term()


def test_vllms_way_out_waits_for_end_and_removes_the_sockets_directory(
        tmp_path: Path) -> None:
    """vLLM's engine core leaves through ``os._exit`` (no exit handlers):
    the connector's shutdown calls ``Handoff.finish``, which waits for the
    recorder's END and removes the directory its sockets were in."""
    h = handoff(tmp_path / "logs", [])
    link: Any = h._link
    world = run_workload(requests=20, seed=18, sink=h.record)
    h.close(world.state)
    assert h.finish()
    assert not link.endpoint_path.parent.exists()
    assert _wait_gone(link.pid)
    assert replay(tmp_path / "logs").ended_cleanly


def test_the_recorder_finds_this_package_without_the_engines_pythonpath(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM may find the connector through ``kv_connector_module_path`` alone:
    the recorder's path starts at the directory that holds ``connector``."""
    from connector.handoff.supervisor import recorder_environment

    monkeypatch.delenv("PYTHONPATH", raising=False)
    first = recorder_environment()["PYTHONPATH"].split(os.pathsep)[0]
    assert (Path(first) / "connector" / "recorder" / "__main__.py").is_file()
