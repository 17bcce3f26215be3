"""``EventSourcedManager`` on a real vLLM ``BlockPool`` (no engine), with faults
injected into the core, the shell and its command executor: nothing reaches
vLLM, pins of stores LMCache holds are kept until their receipts (or lease)
arrive, every other pin is released at once, sessions keep ending, nothing
new is submitted, and ``has_inflight_store_work`` stays true until drained."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from testkit.env import require_stack

require_stack()

from lmcache.integration.vllm.lmcache_mp_metadata import LMCacheMPRequestMetadata  # noqa: E402
from lmcache.integration.vllm.vllm_multi_process_adapter import LoadStoreOp  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id  # noqa: E402

from connector.recorder.recording import EventRecorder  # noqa: E402
from connector.shell import manager as manager_module  # noqa: E402
from connector.shell.manager import EventSourcedManager  # noqa: E402
from offload_fsm import OffloadConfig, Policy  # noqa: E402

BLOCK = 16


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


class Shell:
    """One manager over a real block pool, and a scripted scheduler."""

    def __init__(self, *, log_dir: str | None = None, chunk_tokens: int = 0,
                 beside: bool = False, **config: Any) -> None:
        """``log_dir``: record an event log there (``connector.recorder.recording``);
        ``chunk_tokens``: LMCache's chunk (0: chunk-level dedup off); ``beside``:
        the step's pass on its own thread (``connector.shell.beside``)."""
        self.pool = BlockPool(num_gpu_blocks=64, enable_caching=True, hash_block_size=BLOCK)
        self.clock = Clock()
        settings = {"policy": Policy.FIFO, "threshold": 1, "select_count": 100, **config}
        offload = OffloadConfig(**settings)
        recorder = None if log_dir is None else EventRecorder(
            offload, 1, log_dir, {"package": "test", "vllm": "", "lmcache": ""})
        self.mgr = EventSourcedManager(offload, world_size=1, group_tokens_per_block=[BLOCK],
                                       clock=self.clock, event_log=recorder,
                                       chunk_tokens=chunk_tokens, beside_model=beside)
        self.mgr.bind_block_pool(self.pool)
        self.blocks: dict[str, list[int]] = {}
        self.submitted: list[str] = []
        self.taken: list[LMCacheMPRequestMetadata] = []  # the stores, as built
        self.ended: list[str] = []
        self._hash = 0

    def offer(self, req_id: str, blocks: int = 2) -> list[int]:
        """The request computed ``blocks`` full blocks; offer them as one op."""
        new = self.pool.get_new_blocks(blocks)
        for block in new:
            self._hash += 1
            block.set_block_hash(make_block_hash_with_group_id(self._hash.to_bytes(32, "big"), 0))
        ids = [b.block_id for b in new]
        start = len(self.blocks.get(req_id, [])) * BLOCK
        self.blocks.setdefault(req_id, []).extend(ids)
        op = LoadStoreOp(token_ids=list(range(start + blocks * BLOCK)), block_ids=[ids],
                         start=start, end=start + blocks * BLOCK)
        self.mgr.on_request_arrived(req_id)
        self.mgr.add_store_candidate(LMCacheMPRequestMetadata(
            request_id=req_id, direction="STORE", op=op))
        return ids

    def finish(self, req_id: str) -> None:
        self._take(self.mgr.on_request_finished(req_id))
        # vLLM frees a finished request's blocks (they stay cached in the free queue).
        self.pool.free_blocks(self.pool.blocks[b] for b in self.blocks.pop(req_id, []))

    def step(self, tokens: int = 16, dt_s: float = 1.0) -> None:
        self.clock.now_s += dt_s
        output = SimpleNamespace(
            total_num_scheduled_tokens=tokens, num_scheduled_tokens={},
            scheduled_new_reqs=[],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[],
                                                  new_block_ids=[]),
        )
        self._take(self.mgr.on_scheduler_step(output))
        self.mgr.start_pass()  # as the connector does after LMCache's build_connector_meta

    def receipts(self, completed: dict[str, int], failed: set[str] | None = None) -> None:
        self._take(self.mgr.on_store_results(failed or set(), completed))

    def refs(self, ids: list[int]) -> list[int]:
        return [self.pool.blocks[b].ref_cnt for b in ids]

    def _take(self, actions: Any) -> None:
        self.submitted += [s.request_id for s in actions.stores_to_submit]
        self.taken += actions.stores_to_submit
        self.ended += list(actions.sessions_to_end)


def _in_flight_and_buffered() -> tuple[Shell, list[int], list[int]]:
    """"a" submitted (pinned, awaiting its receipt); "b" finished and buffered
    behind a threshold of 2 that it alone cannot reach."""
    s = Shell()
    a = s.offer("a")
    s.finish("a")
    s.step()
    assert s.submitted == ["a"] and s.refs(a) == [1, 1]
    b = s.offer("b")
    return s, a, b


def test_happy_path_balances_pins_and_ends_sessions() -> None:
    s = Shell()
    a = s.offer("a")
    s.finish("a")
    s.step()
    assert s.submitted == ["a"] and s.mgr.has_inflight_store_work()
    s.receipts({"a": 1})
    assert s.refs(a) == [0, 0] and s.ended == ["a"]
    assert not s.mgr.has_inflight_store_work()


def test_a_rejected_event_keeps_in_flight_pins_until_their_receipts() -> None:
    s, a, _b = _in_flight_and_buffered()
    s.mgr.on_request_finished("a")  # "a" finished twice: the core rejects it
    assert s.mgr.draining
    assert s.refs(a) == [1, 1]  # LMCache may still be copying these
    assert s.mgr.has_inflight_store_work()
    s.finish("b")  # sessions keep ending: "b" never reached LMCache
    assert "b" in s.ended
    s.step()
    assert s.submitted == ["a"]  # nothing new is submitted
    s.receipts({"a": 1})
    assert s.refs(a) == [0, 0] and "a" in s.ended
    assert not s.mgr.has_inflight_store_work()


def test_an_exception_in_the_shell_is_contained(monkeypatch: pytest.MonkeyPatch) -> None:
    s, a, _b = _in_flight_and_buffered()

    def broken(pool: Any, depth: int) -> tuple[int, ...]:
        raise RuntimeError("free queue walk failed")

    monkeypatch.setattr(manager_module.blocks, "free_queue_head", broken)
    s.step()  # would raise into vLLM's engine loop without the guard
    assert s.mgr.draining and s.refs(a) == [1, 1]
    s.receipts({"a": 1})
    assert s.refs(a) == [0, 0] and not s.mgr.has_inflight_store_work()


def test_a_failure_while_building_a_store_releases_its_unsubmitted_pins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = Shell()
    a = s.offer("a")
    s.finish("a")

    def broken(command: Any) -> Any:
        raise KeyError("lost store metadata")

    monkeypatch.setattr(s.mgr._commands.stores, "build", broken)
    s.step()  # protect -> read hashes -> building the store fails
    assert s.mgr.draining and s.submitted == []
    assert s.refs(a) == [0, 0]  # LMCache never saw it: released at once
    assert s.ended == ["a"] and not s.mgr.has_inflight_store_work()


def test_drain_only_lets_a_silent_batch_go_at_its_lease() -> None:
    s, a, _b = _in_flight_and_buffered()
    assert s.mgr.state.config.receipt_lease_s == 300.0  # the default
    s.mgr.on_request_finished("a")  # rejected: drain-only
    s.step(dt_s=100.0)
    assert s.refs(a) == [1, 1]
    s.step(dt_s=200.0)  # 301 s after selection
    assert s.refs(a) == [0, 0] and "a" in s.ended
    assert not s.mgr.has_inflight_store_work()


def test_shutdown_in_drain_only_releases_and_ends_everything() -> None:
    s, a, _b = _in_flight_and_buffered()
    s.mgr.on_request_finished("a")
    s.mgr.log_final_stats()
    assert s.refs(a) == [0, 0]
    s.mgr.log_final_stats()  # idempotent


def test_one_line_per_failed_store(caplog: pytest.LogCaptureFixture) -> None:
    s = Shell()
    s.offer("a")
    s.finish("a")
    s.step()
    with caplog.at_level("WARNING", logger="vllm.lazy_offload"):
        s.receipts({"a": 1}, failed={"a"})
    lines = [r.getMessage() for r in caplog.records if "store failed" in r.getMessage()]
    assert len(lines) == 1 and "req_id=a" in lines[0]


def test_the_error_line_names_the_sequence_number_and_the_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    s, _a, _b = _in_flight_and_buffered()
    with caplog.at_level("ERROR", logger="vllm.lazy_offload"):
        s.mgr.on_request_finished("a")
    (line,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert "seq=" in line and "finished twice" in line and "failed_event=RequestFinished" in line
    assert "kept_blocks=2" in line


def test_a_protect_that_failed_is_never_released(monkeypatch: pytest.MonkeyPatch) -> None:
    """The core counted the pins before the shell's touch raised: drain-only
    releases what the shell really holds, never a block it did not touch."""
    s = Shell()
    a = s.offer("a")
    s.finish("a")

    def broken(pool: Any, block_ids: Any) -> None:
        raise RuntimeError("touch failed")

    monkeypatch.setattr(manager_module.blocks, "touch", broken)
    s.step()
    assert s.mgr.draining and s.mgr.state.pins  # the core believed it held them
    assert s.refs(a) == [0, 0]  # nothing was released below zero
    assert s.ended == ["a"] and not s.mgr.has_inflight_store_work()


def test_a_rejected_answer_is_recorded_once_and_replays(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any,
) -> None:
    """A rejection after other events of the same callback applied (here the
    shell's hash answer, after the step and the protect) records those events
    once, then the REJECTED: replay reproduces the rejection, no divergence."""
    from replay.runner import replay

    s = Shell(log_dir=str(tmp_path))
    s.offer("a")
    s.finish("a")
    hashes_of = manager_module.blocks.hashes_of
    monkeypatch.setattr(manager_module.blocks, "hashes_of",
                        lambda pool, ids, *rest: hashes_of(pool, ids, *rest)[:-1])  # one short
    s.step()
    assert s.mgr.draining
    s.mgr.log_final_stats()
    result = replay(str(tmp_path))
    assert result.divergence is None and not result.lost and not result.damage
    assert result.rejection is not None and result.rejection.reproduced
    assert type(result.rejection.event).__name__ == "HashesRead"
    assert result.ended_cleanly


def test_a_rejection_among_a_steps_observations_records_what_applied_and_drops_the_rest(
    tmp_path: Any,
) -> None:
    """The step's observations wait and apply where the step is read
    (``connector.shell.feeding``). One rejected there: the ones before it are
    applied and recorded once, then the REJECTED; the ones after it never
    reach the closed core (drain-only needs no offer, and ends a session at
    its finish), and the log replays to the same rejection."""
    from replay.runner import replay

    s = Shell(log_dir=str(tmp_path))
    ids = s.offer("a")
    s.mgr.add_store_candidate(LMCacheMPRequestMetadata(  # a gap: the core rejects it
        request_id="a", direction="STORE",
        op=LoadStoreOp(token_ids=list(range(8 * BLOCK)), block_ids=[ids],
                       start=6 * BLOCK, end=8 * BLOCK)))
    s.offer("b")  # after the rejected one: never applied
    assert s.mgr.events_applied == 0  # all of it waits for the step
    s.step()
    assert s.mgr.draining and s.mgr.events_applied == 2  # a's arrival and first offer
    assert "b" not in s.mgr.state.requests
    s.finish("b")
    assert "b" in s.ended
    s.mgr.log_final_stats()
    result = replay(str(tmp_path))
    assert result.divergence is None and not result.lost and not result.damage
    assert result.rejection is not None and result.rejection.reproduced
    assert type(result.rejection.event).__name__ == "CandidateOffered"
    assert result.rejection.event.start_token == 6 * BLOCK
    assert result.ended_cleanly


def test_a_failing_event_log_never_stops_offload(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The recorder's ``record`` raising is the log's failure, not the
    core's: one error line, and offload goes on (no drain-only mode)."""
    s = Shell(log_dir=str(tmp_path))
    recorder = s.mgr.event_log

    def broken(applied: Any, state: Any) -> None:
        raise OSError("the log broke")

    monkeypatch.setattr(recorder, "record", broken)
    a = s.offer("a")
    s.finish("a")
    s.step()
    assert not s.mgr.draining and s.submitted == ["a"]
    s.receipts({"a": 1})
    assert s.refs(a) == [0, 0] and s.ended == ["a"]
    assert sum("the log broke" in r.getMessage() or "the log broke" in str(r.__dict__)
               for r in caplog.records) == 1


def test_a_failing_lookup_report_is_contained() -> None:
    """``on_lookup_result`` (called from LMCache's lookup path) is guarded as
    every hook is: its failure is logged, vLLM goes on, offload goes on."""
    s = Shell(chunk_tokens=BLOCK)
    s.offer("a")
    s.mgr.on_lookup_result("a", 0, None, lambda h: h)  # type: ignore[arg-type]
    assert not s.mgr.draining
    s.finish("a")
    s.step()
    assert s.submitted == ["a"]


def test_a_reset_of_the_pool_reaches_the_core_and_the_log(tmp_path: Any) -> None:
    """vLLM's ``LLM.reset_prefix_cache()`` resets the block pool and tells no
    connector: the pool's own reset is what feeds ``PrefixCacheReset``, once,
    and only when the reset happened (a pool with blocks in use refuses)."""
    from offload_fsm.vocabulary.counters import Counter
    from replay.explain import ExplainObserver
    from replay.runner import replay

    s = Shell(log_dir=str(tmp_path), threshold=5)
    s.offer("a")
    s.offer("b")
    assert not s.pool.reset_prefix_cache()  # "b" still holds its blocks: refused
    assert s.mgr.state.counters[Counter.DROPPED_CACHE_RESET_OPS] == 0
    s.finish("a")
    s.finish("b")
    assert s.pool.reset_prefix_cache()
    assert s.mgr.state.counters[Counter.DROPPED_CACHE_RESET_OPS] == 2
    s.mgr.log_final_stats()
    observer = ExplainObserver("a")
    assert replay(str(tmp_path), observer=observer).ok
    (op,) = observer.ops
    assert op.cause == "cache_reset"
    assert [t for t in (line["text"] for line in observer.lines) if "RESET" in t]
