"""explain gives the cause chain of a drop: what changed the block (a reset,
recorded or not, or the request it was reallocated to), what the pins did
(protected, then lifted), whose completed store made a duplicate, and one line
of what an operator can do."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.offload_fsm.helpers import Harness, ea, shielded_then_cleared
from tests.replay.conftest import record_harness, run_cli

GOLDEN = Path(__file__).parent.parent / "data" / "logs" / "v6"


def _shielded_then_lifted(directory: Path, *, record_reset: bool) -> Path:
    """``a`` finishes into a full free queue (shielded), the engine idles (the
    shield lifts), vLLM resets its prefix cache (told to the core or not),
    and a later step's window reaches ``a``'s blocks."""
    h = Harness(ea())
    shielded_then_cleared(h, "a")
    if record_reset:
        h.reset_cache()
    h.tick(allocated=4, next_blocks=4)
    h.shutdown()
    return record_harness(h, directory)


def _explained(h: Harness, directory: Path, req_id: str) -> str:
    """Shut ``h`` down, record its log under ``directory`` and explain ``req_id``."""
    h.shutdown()
    code, out, err = run_cli("explain", str(record_harness(h, directory)), "--request", req_id)
    assert code == 0, err
    return out


CLEARED_BLOCK_STORIES = {
    "unrecorded_reset_is_a_stale_drop_behind_a_lifted_shield": (False, [
        "shield LIFTED: 4 blocks of 1 ops unpinned",
        "DROPPED [0, 64) (1 ops, 64 tokens): stale",
        "when buffered, none (cleared) when re-read for verification",
        "its hash was cleared, and the log holds no reset",
        "pins: protected at seq 3 (step 1): shielded at finish; released at seq 4 "
        "(step 1): the shield lifted on an empty step",
        "what you can do: if a reset caused it",
    ]),
    "recorded_reset_is_the_cause": (True, [
        "the prefix cache was RESET",
        "DROPPED [0, 64) (1 ops, 64 tokens): cache_reset",
        "vLLM reset its prefix cache at seq 5",
        "released at seq 4 (step 1): the shield lifted on an empty step",
        "what you can do: expected after reset_prefix_cache()",
    ]),
}


@pytest.mark.parametrize("case", sorted(CLEARED_BLOCK_STORIES))
def test_a_cleared_block_names_its_cause(tmp_path: Path, case: str) -> None:
    record_reset, expected = CLEARED_BLOCK_STORIES[case]
    log = _shielded_then_lifted(tmp_path, record_reset=record_reset)
    code, out, err = run_cli("explain", str(log), "--request", "a")
    assert code == 0, err
    for line in expected:
        assert line in out, (line, out)


def test_a_duplicate_names_the_request_and_batch_that_stored_the_content() -> None:
    code, out, err = run_cli("explain", str(GOLDEN), "--request", "s2t0")
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
    out = _explained(h, tmp_path, "a")
    assert "evicted" in out
    assert "what changed it: vLLM reallocated the block to request b" in out
    assert "what you can do: drain sooner" in out


def test_an_evicted_op_whose_content_another_request_stored_says_nothing_was_lost(
        tmp_path: Path) -> None:
    """``a`` and ``b`` buffered the same content on blocks of their own; ``a``'s
    store completes, then a block of ``b``'s is reallocated: the core counts
    ``b``'s op as evicted, and explain says whose batch holds its content and
    that there is nothing to do (not "drain sooner")."""
    h = Harness(ea())
    h.arrive("a", "b")
    for req_id, blocks in (("a", (0, 1)), ("b", (2, 3))):
        h.hashes.update(zip(blocks, (101, 102), strict=True))
        h.offer(req_id, blocks=blocks, hashes=(101, 102), tokens=64, blocks_per_chunk=1)
    h.queue = [0, 1]
    h.tick(allocated=1, next_blocks=1, requests=0)
    h.complete("a")
    h.tick(allocated=1, next_blocks=1, requests=0, reallocated=[(2, 999)])
    out = _explained(h, tmp_path, "b")
    assert "evicted" in out
    assert "its content was already stored: request a, batch 0" in out
    assert "what you can do: nothing: LMCache holds every chunk of it" in out
    assert "drain sooner" not in out


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
    out = _explained(h, tmp_path, "a")
    assert ("shielded 1 ops (2 blocks protected at a lookup: request w's LMCache answer lets "
            "vLLM allocate 12 blocks at once, reaching 14 blocks into the free queue of 42, "
            "before any drain)") in out
    assert "selected [0, 64) (1 ops) into batch 0: shielded" in out
    assert "1 ops STORED" in out
