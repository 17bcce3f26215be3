"""The shell's side of the tail flush over a real vLLM ``BlockPool``: the
keepalive vLLM reads (``has_inflight_store_work``), the shutdown signal
turned into ``ShutdownBegan`` on the next step, the bounded wait, the
one line of what was left, the SIGTERM hook chained before vLLM's, and the
log sealed as soon as vLLM may stop (before it stops its workers)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from connector.shell import shutdown_signal
from replay.runner import replay
from tests.connector.test_manager_faults import Shell


def test_the_idle_flush_keeps_vllm_stepping_until_the_tail_is_stored() -> None:
    shell = Shell(threshold=100, idle_flush_steps=3)
    shell.offer("a")
    shell.step()
    shell.finish("a")
    assert shell.mgr.has_inflight_store_work()  # buffered tail: vLLM must keep stepping
    shell.step(tokens=0)
    shell.step(tokens=0)
    assert shell.submitted == []
    shell.step(tokens=0)
    assert shell.submitted == ["a"]
    assert shell.mgr.has_inflight_store_work()  # its receipt
    shell.receipts({"a": 1})
    assert shell.ended == ["a"] and not shell.mgr.has_inflight_store_work()


def test_off_the_buffered_tail_keeps_nothing_alive() -> None:
    shell = Shell(threshold=100)
    shell.offer("a")
    shell.step()
    shell.finish("a")
    shell.mgr.shutdown_began()  # no flush while the shutdown flush is off
    assert not shell.mgr.has_inflight_store_work()
    for _ in range(10):
        shell.step(tokens=0)
    assert shell.submitted == []


def test_the_shutdown_signal_flushes_on_the_next_step_and_the_wait_is_bounded(
    caplog: pytest.LogCaptureFixture,
) -> None:
    shell = Shell(threshold=100, shutdown_flush_s=2.0)
    shell.offer("a")
    shell.offer("b")
    shell.step()
    shell.finish("a")
    shell.finish("b")
    assert not shell.mgr.has_inflight_store_work()  # no idle flush: the tail waits
    shell.mgr.shutdown_began()  # what the SIGTERM hook calls
    assert shell.mgr.has_inflight_store_work()  # one more step, to flush
    shell.step(tokens=0, dt_s=0.5)
    assert sorted(shell.submitted) == ["a", "b"]
    shell.receipts({"a": 1})
    assert shell.mgr.has_inflight_store_work()  # "b" still in flight, 0.5 s into the wait
    shell.clock.now_s += 2.0
    assert not shell.mgr.has_inflight_store_work()  # the wait is over: vLLM may stop
    with caplog.at_level(logging.INFO, logger="vllm.lazy_offload"):
        shell.mgr.log_final_stats()
    left = [r.getMessage() for r in caplog.records if "left at shutdown" in r.getMessage()]
    assert len(left) == 1
    assert "requests=1 ops=1 tokens=32 buffered_ops=0 in_flight_ops=1" in left[0]  # 2 blocks
    assert "shutdown_flush_ops=2" in left[0] and "signal_seen=True" in left[0]


def test_the_hook_runs_before_the_handler_it_chains_and_only_where_one_is() -> None:
    calls: list[str] = []
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def vllm_handler(signum: int, frame: Any) -> None:
        calls.append(f"vllm {signum}")

    def application_handler(signum: int, frame: Any) -> None:
        calls.append("application")

    vllm_handler.__module__ = shutdown_signal.VLLM_ENGINE_CORE  # as vLLM's engine core's is
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        assert not shutdown_signal.install(lambda: calls.append("ours"))  # no handler to chain
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        signal.signal(signal.SIGTERM, application_handler)
        assert not shutdown_signal.install(lambda: calls.append("ours"))  # not vLLM's
        assert signal.getsignal(signal.SIGTERM) is application_handler
        signal.signal(signal.SIGTERM, vllm_handler)
        assert shutdown_signal.install(lambda: calls.append("ours"))
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)  # type: ignore[operator]
        assert calls == ["ours", f"vllm {int(signal.SIGTERM)}"]
        assert "lazy-offload-signal" in {thread.name for thread in threading.enumerate()}
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)
        wakeup_fd = signal.set_wakeup_fd(-1)  # the forwarder's: end its thread
        if wakeup_fd != -1:
            with socket.socket(fileno=os.dup(wakeup_fd)) as writer:
                writer.shutdown(socket.SHUT_RDWR)


def test_after_the_signal_the_log_is_sealed_as_soon_as_vllm_may_stop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """vLLM stops its workers (5 s grace) before it calls the connector's
    shutdown and kills the engine 5 s after SIGTERM: the END and the ledger
    line are written when we first answer "no work" after the signal."""
    shell = Shell(threshold=100, log_dir=str(tmp_path))
    shell.offer("a")
    shell.step()
    shell.finish("a")
    assert shell.mgr.has_inflight_store_work() is False
    assert not replay(tmp_path).ended_cleanly  # no signal yet: no seal
    shell.mgr.shutdown_began()
    with caplog.at_level(logging.INFO, logger="vllm.lazy_offload"):
        assert shell.mgr.has_inflight_store_work() is False
        sealed = replay(tmp_path)
        assert sealed.ok and sealed.ended_cleanly
        # A request vLLM still takes in: drain-only, nothing stored, its session ends.
        shell.offer("late")
        shell.step()
        shell.finish("late")
        shell.mgr.log_final_stats()  # vLLM's connector shutdown, later
    lines = [r.getMessage() for r in caplog.records]
    assert sum("Lazy offload final counters" in line for line in lines) == 1
    assert any("after the log was sealed" in line and "sessions_ended=1" in line
               for line in lines), lines
    assert shell.submitted == [] and "late" in shell.ended
    again = replay(tmp_path)
    assert again.ok and again.ended_cleanly and again.header == sealed.header


def test_no_seal_while_a_store_is_in_flight(tmp_path: Path) -> None:
    shell = Shell(threshold=1, log_dir=str(tmp_path))
    shell.offer("a")
    shell.step()
    shell.finish("a")
    shell.step()
    assert shell.submitted == ["a"]
    shell.mgr.shutdown_began()
    assert shell.mgr.has_inflight_store_work()  # its receipt: keep stepping, no seal
    assert not replay(tmp_path).ended_cleanly
    shell.receipts({"a": 1})
    assert not shell.mgr.has_inflight_store_work()
    result = replay(tmp_path)
    assert result.ok and result.ended_cleanly
    assert "a" in shell.ended


class _SignalOnRead:
    """A clock whose ``n``-th read runs the SIGTERM hook first, as if the
    signal had come while the scheduler thread was inside the call."""

    def __init__(self, clock: Any, mgr: Any, n: int) -> None:
        self.clock, self.mgr, self.reads_left = clock, mgr, n

    def __call__(self) -> float:
        self.reads_left -= 1
        if self.reads_left == 0:
            self.mgr.shutdown_began()
        return self.clock()


def test_a_signal_in_the_middle_of_the_work_question_still_flushes(tmp_path: Path) -> None:
    """The handler runs between two bytecodes of the scheduler thread: a
    signal that lands after ``has_inflight_store_work`` computed "no work"
    must not seal the log with the tail unflushed (it did: CI saw a
    shutdown flush store nothing); the next question flushes."""
    shell = Shell(threshold=100, shutdown_flush_s=2.0, log_dir=str(tmp_path))
    shell.offer("a")
    shell.step()
    shell.finish("a")
    shell.mgr._clock = _SignalOnRead(shell.clock, shell.mgr, n=1)  # keeps_stepping's read
    assert shell.mgr.has_inflight_store_work() is False  # computed before the signal
    assert not replay(tmp_path).ended_cleanly  # not sealed: the tail is still to flush
    assert shell.mgr.has_inflight_store_work()  # asked again: one step, to flush
    shell.step(tokens=0)
    assert shell.submitted == ["a"]
    shell.receipts({"a": 1})
    assert not shell.mgr.has_inflight_store_work()
    result = replay(tmp_path)
    assert result.ok and result.ended_cleanly
