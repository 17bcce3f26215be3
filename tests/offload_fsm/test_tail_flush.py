"""The tail flush (``offload_fsm.rules.tail_flush``): off by default; after
``idle_flush_steps`` consecutive empty steps, or inside the shutdown wait
after ``ShutdownBegan``, the intact buffered ops of finished requests are
selected and go through the usual verification; its counters show the
cost; the keepalive query ends; a replay of the events reproduces it."""

from __future__ import annotations

import pytest

from offload_fsm import check_all, new_state, step
from offload_fsm.digest import canonical_state, state_digest
from offload_fsm.invariants import quiet_on_empty_steps
from offload_fsm.queries import keeps_stepping
from offload_fsm.vocabulary.commands import SubmitStore
from offload_fsm.vocabulary.counters import FIRST_LATER_COUNTER, Counter
from offload_fsm.vocabulary.decisions import (
    DropCause,
    FlushTrigger,
    OpsDropped,
    OpsSelected,
    SelectReason,
    ShutdownFlushBegan,
    ShutdownLeft,
    TailFlushed,
)
from offload_fsm.vocabulary.errors import InvalidEvent
from offload_fsm.vocabulary.events import ShutdownBegan

from .helpers import OP_TOKENS, Harness, ea, fifo


def _tail(config_overrides: dict[str, object], *, policy: str = "fifo") -> Harness:
    """"done" finished with 2 buffered ops, "live" is running with 1: below
    FIFO's threshold, so the policy alone never drains either."""
    make = fifo if policy == "fifo" else ea
    extra = {"threshold": 100} if policy == "fifo" else {}
    h = Harness(make(**extra, **config_overrides))  # type: ignore[arg-type]
    h.arrive("done", "live")
    h.offer_ops("done", 2)
    h.offer("live")
    h.tick()
    h.finish("done")
    return h


def _later_counters(h: Harness) -> dict[str, int]:
    return {c.value: v for c, v in list(h.state.counters.items())[FIRST_LATER_COUNTER:] if v}


def test_off_by_default_an_idle_engine_flushes_nothing() -> None:
    h = _tail({})
    for _ in range(50):
        step_ = h.empty_step()
        assert step_.of(OpsSelected) == [] and step_.of(SubmitStore) == []
    h.feed(ShutdownBegan(time_s=h.time_s))  # recorded, ignored while the flush is off
    h.empty_step()
    assert not any(isinstance(c, SubmitStore) for c in h.all_commands())
    assert (h.state.idle_steps, h.state.shutdown_until_s) == (0, None)
    assert _later_counters(h) == {}
    assert not keeps_stepping(h.state, h.time_s)  # a ready tail alone keeps nothing alive
    assert [d for d in h.all_decisions() if isinstance(d, TailFlushed | ShutdownFlushBegan)] == []
    left = h.shutdown()
    assert left.of(ShutdownLeft) == []  # the shutdown record is as before the knobs
    assert _later_counters(h) == {}


def test_the_nth_empty_step_flushes_finished_requests_only() -> None:
    h = _tail({"idle_flush_steps": 3})
    assert keeps_stepping(h.state, h.time_s)  # a ready tail: vLLM must keep stepping
    for idle in (1, 2):
        assert h.empty_step().of(SubmitStore) == []
        assert h.state.idle_steps == idle
    flushed = h.empty_step()
    submit = flushed.one(SubmitStore)
    assert (submit.req_id, submit.start_token, submit.end_token) == ("done", 0, 2 * OP_TOKENS)
    selected = flushed.one(OpsSelected)
    assert (selected.req_id, selected.reason, selected.ops) == ("done", SelectReason.IDLE_FLUSH, 2)
    assert flushed.one(TailFlushed) == TailFlushed(
        trigger=FlushTrigger.IDLE, requests=1, ops=2, tokens=2 * OP_TOKENS, idle_steps=3)
    assert [op.start_token for op in h.state.requests["live"].ops] == [0]  # running: kept
    counters = h.state.counters
    assert counters[Counter.IDLE_FLUSH_OPS] == 2
    assert counters[Counter.IDLE_FLUSH_TOKENS] == 2 * OP_TOKENS
    assert counters[Counter.IDLE_FLUSHES] == 1
    assert counters[Counter.SUBMITTED_OPS] == 2
    assert keeps_stepping(h.state, h.time_s)  # in flight
    h.complete("done")
    assert not keeps_stepping(h.state, h.time_s)  # nothing ready, nothing in flight: vLLM rests
    later = h.empty_step()  # more idle steps flush nothing more
    assert later.of(TailFlushed) == [] and counters[Counter.IDLE_FLUSHES] == 1
    assert check_all(h.state) == []


def test_a_token_step_resets_the_idle_count() -> None:
    h = _tail({"idle_flush_steps": 3})
    h.empty_step()
    h.empty_step()
    h.tick()  # traffic again
    assert h.state.idle_steps == 0
    assert h.empty_step().of(SubmitStore) == []
    assert h.empty_step().of(SubmitStore) == []
    assert h.empty_step().one(SubmitStore).req_id == "done"


def test_a_request_that_finishes_after_the_flush_is_flushed_on_the_next_empty_step() -> None:
    h = _tail({"idle_flush_steps": 1})
    assert h.empty_step().one(SubmitStore).req_id == "done"
    h.finish("live")
    assert h.empty_step().one(SubmitStore).req_id == "live"
    assert h.state.counters[Counter.IDLE_FLUSHES] == 2


def test_the_flush_rechecks_hashes_and_never_stores_a_reused_block() -> None:
    h = _tail({"idle_flush_steps": 2})
    reused = h.blocks_of["done"][1][0]
    h.hashes[reused] = 424_242  # vLLM gave the block to other content meanwhile
    h.empty_step()
    flushed = h.empty_step()
    submit = flushed.one(SubmitStore)
    assert (submit.start_token, submit.end_token) == (0, OP_TOKENS)  # the verified prefix
    dropped = flushed.one(OpsDropped)
    assert (dropped.cause, dropped.start_token, dropped.block_id) == (
        DropCause.STALE, OP_TOKENS, reused)
    assert h.state.counters[Counter.IDLE_FLUSH_OPS] == 2  # selected: the flush's cost bound
    assert h.state.counters[Counter.SUBMITTED_OPS] == 1


def test_ops_already_lost_to_eviction_are_not_flushed() -> None:
    h = _tail({"idle_flush_steps": 1}, policy="ea")
    lost = h.blocks_of["done"][0][0]
    h.tick(allocated=2, reallocated=[(lost, 777_777)])  # evicted before any drain
    assert h.state.counters[Counter.DROPPED_EVICTED_OPS] == 2
    flushed = h.empty_step()
    assert flushed.of(SubmitStore) == [] and flushed.of(TailFlushed) == []


def test_the_shutdown_flush_submits_the_tail_and_bounds_the_wait() -> None:
    h = _tail({"shutdown_flush_s": 5.0})
    assert not keeps_stepping(h.state, h.time_s)  # before shutdown: no idle flush
    began = h.feed(ShutdownBegan(time_s=h.time_s))
    assert began.one(ShutdownFlushBegan).until_s == h.time_s + 5.0
    h.finish("live")  # vLLM aborts the running request at shutdown
    flushed = h.empty_step()
    assert sorted(s.req_id for s in flushed.of(SubmitStore)) == ["done", "live"]
    assert flushed.one(TailFlushed).trigger is FlushTrigger.SHUTDOWN
    counters = h.state.counters
    assert counters[Counter.SHUTDOWN_FLUSH_OPS] == 3
    assert counters[Counter.SHUTDOWN_FLUSH_TOKENS] == 3 * OP_TOKENS
    h.complete("done")
    assert keeps_stepping(h.state, h.time_s)  # "live" still in flight
    assert not keeps_stepping(h.state, h.time_s + 5.0)  # the wait is over: let vLLM stop
    left = h.shutdown().one(ShutdownLeft)
    assert left == ShutdownLeft(requests=1, buffered_ops=0, buffered_tokens=0,
                                in_flight_ops=1, in_flight_tokens=OP_TOKENS)
    assert counters[Counter.SHUTDOWN_LEFT_OPS] == 1
    assert counters[Counter.SHUTDOWN_LEFT_TOKENS] == OP_TOKENS
    assert counters[Counter.SHUTDOWN_LEFT_REQUESTS] == 1
    assert counters[Counter.ABANDONED_OPS] == 1


def test_after_the_shutdown_wait_nothing_more_is_flushed() -> None:
    h = _tail({"shutdown_flush_s": 2.0})
    h.feed(ShutdownBegan(time_s=h.time_s))
    late = h.empty_step(dt_s=3.0)
    assert late.of(SubmitStore) == []
    left = h.shutdown().one(ShutdownLeft)
    assert (left.requests, left.buffered_ops, left.buffered_tokens) == (2, 3, 3 * OP_TOKENS)


def test_shutdown_began_twice_or_back_in_time_is_rejected() -> None:
    h = _tail({"shutdown_flush_s": 2.0})
    h.feed(ShutdownBegan(time_s=h.time_s))
    with pytest.raises(InvalidEvent, match="twice"):
        h.feed(ShutdownBegan(time_s=h.time_s))
    back = _tail({"shutdown_flush_s": 2.0})
    with pytest.raises(InvalidEvent, match="time went back"):
        back.feed(ShutdownBegan(time_s=back.time_s - 1.0))


def test_the_invariant_allows_only_the_configured_flush() -> None:
    h = _tail({"idle_flush_steps": 2})
    h.empty_step()
    state = h.state
    state.selected_in_step = state.flushed_in_step = 2  # a flush one step early
    assert "before 2 idle steps" in quiet_on_empty_steps(state)[0]
    state.flushed_in_step = 0  # a selection on an empty step by anything else
    assert "not by the tail flush" in quiet_on_empty_steps(state)[0]


@pytest.mark.parametrize("overrides", [{"idle_flush_steps": 2},
                                       {"shutdown_flush_s": 3.0, "idle_flush_steps": 4}])
def test_replaying_the_events_reproduces_every_outcome_and_digest(
    overrides: dict[str, object]
) -> None:
    h = _tail(overrides)
    if "shutdown_flush_s" in overrides:
        h.feed(ShutdownBegan(time_s=h.time_s))
    for _ in range(3):
        h.empty_step()
    h.complete("done")
    h.empty_step()
    h.shutdown()
    replayed = new_state(h.state.config, world_size=1)
    for event, outcome in h.log:
        assert step(replayed, event) == outcome
    assert state_digest(replayed) == state_digest(h.state)
    assert canonical_state(replayed)[-2:] == (h.state.idle_steps, h.state.shutdown_until_s)
