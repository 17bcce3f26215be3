"""The step's pass beside the model (``connector.shell.beside``): it runs on its
own thread, every hook and every pool call vLLM makes wait for it, a signal
handler does not, its stores go out with the next step, receipts wait for the
next pass, and its failures and shutdown lose nothing."""

from __future__ import annotations

import sys
import threading
import time
import weakref
from typing import Any

import pytest

from testkit.env import require_stack

require_stack()

from vllm.v1.core.block_pool import BlockPool  # noqa: E402

from connector.shell import manager as manager_module  # noqa: E402
from connector.shell.beside import Beside, guard_pool  # noqa: E402
from offload_fsm import Policy  # noqa: E402
from offload_fsm.state import Phase  # noqa: E402
from tests.connector.test_manager_faults import Shell  # noqa: E402

WAIT_S = 5.0


def _failed(name: str, error: Exception) -> None:
    raise AssertionError(f"{name}: {error!r}")


def _blocking_pass(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Make the manager's next step read wait: (the pass reached it, let it go on)."""
    reached, go_on = threading.Event(), threading.Event()
    walk = manager_module.blocks.free_queue_head

    def held(pool: Any, depth: int) -> tuple[int, ...]:
        reached.set()
        assert go_on.wait(WAIT_S)
        return walk(pool, depth)

    monkeypatch.setattr(manager_module.blocks, "free_queue_head", held)
    return reached, go_on


def test_a_pass_runs_on_its_own_thread_and_settle_waits_for_it() -> None:
    beside = Beside(threaded=True, failed=_failed)
    started, release = threading.Event(), threading.Event()
    ran_on: list[int] = []

    def job() -> None:
        ran_on.append(threading.get_ident())
        started.set()
        assert release.wait(WAIT_S)

    beside.start(job)
    assert started.wait(WAIT_S)
    threading.Timer(0.2, release.set).start()
    t0 = time.monotonic()
    beside.settle()
    assert time.monotonic() - t0 >= 0.15
    assert ran_on and ran_on[0] != threading.get_ident()
    beside.close()
    beside.start(lambda: ran_on.append(threading.get_ident()))  # closed: inline
    assert ran_on[-1] == threading.get_ident()


def test_a_finished_pass_lets_go_of_its_job() -> None:
    """The job holds vLLM's scheduler output: once the pass is over, nothing
    of the pass keeps it until the next one."""

    class Job:
        def __call__(self) -> None:
            pass

    beside = Beside(threaded=True, failed=_failed)
    job = Job()
    gone = weakref.ref(job)
    beside.start(job)
    del job
    beside.settle()
    assert gone() is None
    beside.close()


def test_a_pass_that_raises_is_reported_and_the_next_one_runs() -> None:
    failures: list[str] = []
    beside = Beside(threaded=True, failed=lambda name, error: failures.append(repr(error)))

    def broken() -> None:
        raise RuntimeError("pass failed")

    beside.start(broken)
    beside.settle()
    assert failures == ["RuntimeError('pass failed')"]
    done = threading.Event()
    beside.start(done.set)
    beside.settle()
    assert done.is_set() and beside.threaded
    beside.close()


def test_a_pass_that_ends_the_thread_still_ends_and_later_passes_run_inline() -> None:
    beside = Beside(threaded=True, failed=_failed)
    beside.start(lambda: sys.exit("the thread ends"))
    waiter = threading.Thread(target=beside.settle, daemon=True)
    waiter.start()
    waiter.join(WAIT_S)
    assert not waiter.is_alive()
    deadline = time.monotonic() + WAIT_S
    while beside.threaded and time.monotonic() < deadline:
        time.sleep(0.01)
    ran_on: list[int] = []
    beside.start(lambda: ran_on.append(threading.get_ident()))
    assert ran_on == [threading.get_ident()]


def test_vllm_s_pool_calls_wait_for_the_pass_then_run_unguarded() -> None:
    pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=16)
    own = pool.reset_prefix_cache
    pool.reset_prefix_cache = own  # an instance attribute, as blocks.report_resets leaves
    beside = Beside(threaded=True, failed=_failed)
    guard_pool(pool, beside)
    order: list[str] = []
    inside = threading.Event()

    def step_pass() -> None:
        order.append(f"pass reads {pool.get_num_free_blocks()}")  # its own calls go through
        inside.set()
        time.sleep(0.2)
        pool.touch([pool.blocks[1]])
        order.append("pass done")

    beside.start(step_pass)
    assert inside.wait(WAIT_S)
    free = pool.get_num_free_blocks()  # vLLM's next call: after the pass's pin
    order.append(f"vllm reads {free}")
    assert order == ["pass reads 15", "pass done", "vllm reads 14"]
    assert "get_num_free_blocks" not in pool.__dict__  # disarmed at the settle
    assert pool.reset_prefix_cache is own  # what was there before came back
    beside.close()


def test_a_signal_handler_hook_does_not_wait_for_the_pass(
        monkeypatch: pytest.MonkeyPatch) -> None:
    s = Shell(beside=True, shutdown_flush_s=5.0)
    s.offer("a")
    reached, go_on = _blocking_pass(monkeypatch)
    s.step()
    assert reached.wait(WAIT_S)
    t0 = time.monotonic()
    s.mgr.shutdown_began()  # inside a signal handler, it may interrupt a settle
    assert time.monotonic() - t0 < 1.0
    go_on.set()
    s.mgr.settle()
    s.mgr.log_final_stats()


def test_beside_the_model_a_step_s_stores_go_out_with_the_next_step() -> None:
    s = Shell(beside=True)
    a = s.offer("a")
    s.finish("a")
    s.step()  # FIFO selects "a" in this step's pass
    s.mgr.settle()
    assert s.submitted == [] and s.refs(a) == [1, 1]  # pinned, not yet handed over
    s.step()
    assert s.submitted == ["a"]
    s.receipts({"a": 1})
    assert s.refs(a) == [1, 1] and s.mgr.has_inflight_store_work()  # waits for a pass
    s.step()
    s.mgr.settle()
    assert s.refs(a) == [0, 0]
    s.step()
    assert s.ended == ["a"] and not s.mgr.has_inflight_store_work()
    s.mgr.log_final_stats()


def test_beside_the_model_a_finish_that_pins_nothing_waits_for_the_next_pass() -> None:
    """A finish whose shield would pin nothing (the engine idle here: depth 0)
    is held for the next pass; vLLM is told to step once more for it, and
    that pass applies it before the step, as a finish applied at once would
    have been."""
    s = Shell(beside=True, policy=Policy.EVICTION_AWARE)
    s.offer("a")
    s.step()
    s.mgr.settle()
    s.finish("a")
    assert s.mgr.state.requests["a"].phase is Phase.ACTIVE  # not applied yet
    assert s.mgr.has_inflight_store_work()  # a step to apply it
    s.step()
    s.mgr.settle()
    assert s.mgr.state.requests["a"].phase is Phase.FINISHED
    assert not s.mgr.has_inflight_store_work()
    s.mgr.log_final_stats()


def test_a_failed_pass_hands_the_receipts_it_had_not_applied_to_the_drain(
        monkeypatch: pytest.MonkeyPatch) -> None:
    s = Shell(beside=True)
    a = s.offer("a")
    s.finish("a")
    s.step()
    s.step()
    assert s.submitted == ["a"]
    s.offer("b")  # its offer is built in the next pass, and fails there
    s.receipts({"a": 1})  # waits behind it

    def broken(*args: Any) -> tuple[int, ...]:
        raise RuntimeError("hash read failed")

    monkeypatch.setattr(manager_module.blocks, "hashes_of", broken)
    s.step()
    assert s.mgr.draining
    assert s.refs(a) == [0, 0] and not s.mgr.has_inflight_store_work()


def test_shutdown_drops_the_stores_not_yet_handed_over() -> None:
    s = Shell(beside=True)
    a = s.offer("a")
    s.finish("a")
    s.step()
    s.mgr.settle()
    assert s.refs(a) == [1, 1] and s.submitted == []
    s.mgr.log_final_stats()  # the batch is abandoned: its pins go, its store must not
    assert s.refs(a) == [0, 0]
    s.step()
    s.step()
    assert s.submitted == []
