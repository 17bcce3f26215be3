"""explain gives the cause chain of a drop: what changed the block (a reset,
recorded or not, or the request it was reallocated to), what the pins did
(protected, then lifted), whose completed store made a duplicate, and one line
of what an operator can do."""

from __future__ import annotations

import io
from pathlib import Path

from connector.recording import EventRecorder
from replay.cli import main
from tests.offload_fsm.helpers import Harness, ea
from tests.replay.conftest import VERSIONS

GOLDEN = Path(__file__).parent.parent / "data" / "logs" / "v6"


def _explain(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(["explain", *argv], out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def _shielded_then_lifted(directory: Path, *, record_reset: bool) -> Path:
    """``a`` finishes into a full free queue (shielded), the engine idles (the
    shield lifts), vLLM resets its prefix cache (told to the core or not),
    and a later step's window reaches ``a``'s blocks."""
    h = Harness(ea())
    h.arrive("a")
    blocks = h.new_blocks(4)
    h.offer("a", blocks=blocks)
    h.queue = list(range(100, 140))
    h.tick(allocated=8, next_blocks=8)
    h.queue = [*blocks, *range(100, 140)]
    h.finish("a", free=2)
    h.empty_step()
    for block_id in blocks:
        h.hashes[block_id] = None
    if record_reset:
        h.reset_cache()
    h.tick(allocated=4, next_blocks=4)
    h.shutdown()
    recorder = EventRecorder(h.state.config, 1, str(directory), VERSIONS, prefix="run",
                             register_atexit=False)
    recorder.record(h.log, h.state)
    recorder.close(h.state)
    return directory


def test_a_stale_drop_names_the_cleared_hash_and_the_lifted_shield(tmp_path: Path) -> None:
    log = _shielded_then_lifted(tmp_path, record_reset=False)
    code, out, err = _explain(str(log), "--request", "a")
    assert code == 0, err
    assert "shield LIFTED: 4 blocks of 1 ops unpinned" in out
    assert "DROPPED [0, 64) (1 ops, 64 tokens): stale" in out
    assert "when buffered, none (cleared) when re-read for verification" in out
    assert "its hash was cleared, and the log holds no reset" in out
    assert ("pins: protected at seq 3 (step 1): shielded at finish; released at seq 4 "
            "(step 1): the shield lifted on an empty step") in out
    assert "what you can do: if a reset caused it" in out


def test_a_recorded_reset_is_the_cause(tmp_path: Path) -> None:
    log = _shielded_then_lifted(tmp_path, record_reset=True)
    code, out, err = _explain(str(log), "--request", "a")
    assert code == 0, err
    assert "the prefix cache was RESET" in out
    assert "DROPPED [0, 64) (1 ops, 64 tokens): cache_reset" in out
    assert "vLLM reset its prefix cache at seq 5" in out
    assert "released at seq 4 (step 1): the shield lifted on an empty step" in out
    assert "what you can do: expected after reset_prefix_cache()" in out


def test_a_duplicate_names_the_request_and_batch_that_stored_the_content() -> None:
    code, out, err = _explain(str(GOLDEN), "--request", "s2t0")
    assert code == 0, err
    assert "DROPPED [0, 1280) (1 ops, 1280 tokens): duplicate" in out
    assert ("4 chunk(s) stored by request s52t0, batch 0: its store COMPLETED (settled at "
            "seq 785, step 428)") in out


def test_a_reallocated_block_names_its_new_request(tmp_path: Path) -> None:
    h = Harness(ea())
    h.arrive("a", "b")
    blocks = h.new_blocks(4)
    h.offer("a", blocks=blocks)
    h.finish("a", free=0)
    h.empty_step()  # the shield lifts: nothing protects a's blocks now
    h.offer("b", blocks=blocks[:2], hashes=(77, 78))
    h.tick(allocated=2, reallocated=((blocks[0], 77), (blocks[1], 78)))
    h.shutdown()
    recorder = EventRecorder(h.state.config, 1, str(tmp_path), VERSIONS, prefix="run",
                             register_atexit=False)
    recorder.record(h.log, h.state)
    recorder.close(h.state)
    code, out, err = _explain(str(tmp_path), "--request", "a")
    assert code == 0, err
    assert "evicted" in out
    assert "what changed it: vLLM reallocated the block to request b" in out
    assert "what you can do: drain sooner" in out


def test_a_lookup_shield_names_the_request_and_its_allocation(tmp_path: Path) -> None:
    """``a`` finished with its blocks deep in the free queue; ``w``'s lookup
    lets vLLM allocate past them: explain says they were protected at that
    lookup, by whom and how far it reached, then stored."""
    from offload_fsm.vocabulary.events import LookupAnswered

    h = Harness(ea())
    h.queue = list(range(100, 140))
    h.arrive("a", "w")
    blocks = h.new_blocks(2)
    h.offer("a", blocks=blocks)
    h.finish("a", free=40)
    h.queue[10:10] = list(blocks)
    h.feed(LookupAnswered(req_id="w", allocation_blocks=12, free_blocks=42,
                          window_block_ids=tuple(h.queue[:14])))
    h.tick(allocated=12)
    h.complete("a")
    h.shutdown()
    recorder = EventRecorder(h.state.config, 1, str(tmp_path), VERSIONS, prefix="run",
                             register_atexit=False)
    recorder.record(h.log, h.state)
    recorder.close(h.state)
    code, out, err = _explain(str(tmp_path), "--request", "a")
    assert code == 0, err
    assert ("shielded 1 ops (2 blocks protected at a lookup: request w's LMCache answer lets "
            "vLLM allocate 12 blocks at once, reaching 14 blocks into the free queue of 42, "
            "before any drain)") in out
    assert "selected [0, 64) (1 ops) into batch 0: shielded" in out
    assert "1 ops STORED" in out
