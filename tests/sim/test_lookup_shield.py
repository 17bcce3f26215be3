"""vLLM's real ``Scheduler`` takes a waiting request's whole LMCache hit from
the free queue's head in the ``schedule()`` that looked it up, before any
drain of that step: a finished request's buffered blocks within that reach
are protected at the lookup (``LookupAnswered``), drained by the same step's
``build_connector_meta`` and stored, instead of being reallocated to the hit.

The scene (32-token blocks, 256-token chunks): request A (512 tokens, two
chunks, 16 blocks) and four short requests (255 tokens, no whole chunk, 8
blocks each) prefill in one step; A and three short ones finish, A first,
so the free queue ends with A's blocks and then 24 blocks no buffered op
covers, and one short request goes on decoding (the steps after schedule
tokens, so their drains run). A's blocks are far beyond the danger window
and the finish-time shield's reach. Then B arrives, whose 6,144-token prefix
LMCache holds: its asynchronous load allocates 192 blocks at once, and the
free queue's first 192 blocks end 5 blocks into A's (the short requests'
partial last blocks, unhashed, went to the queue's head)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from testkit.env import require_stack

require_stack()  # skips without vLLM and LMCache; fails under CI=true

from bench.sim.arms import BLOCK_TOKENS, LAZY, ArmSpec, SimParams  # noqa: E402
from bench.sim.loop import Sim  # noqa: E402
from bench.sim.standin import CHUNK_TOKENS  # noqa: E402
from offload_fsm.vocabulary.counters import Counter  # noqa: E402

SHORT = 4  # short requests freed behind A
FREE_BEFORE_A = 184  # blocks the first step leaves unused
B_HIT_BLOCKS = 192  # B's LMCache hit, in blocks: reaches 5 of A's 16


def _sim() -> Sim:
    blocks = 1 + FREE_BEFORE_A + 16 + 8 * SHORT  # the null block, then the rest
    params = SimParams(num_gpu_blocks=blocks, max_num_seqs=8, max_num_batched_tokens=2048,
                       seed=1, max_steps=100)
    arm = ArmSpec(name="ours EA", kind="ours",
                  extra=(LAZY, ("lmcache.mp.lazy_offload_policy", "EVICTION_AWARE"),
                         ("lmcache.mp.lazy_offload_log_dir", "")))
    return Sim(arm, [], params)


def _add(sim: Sim, rid: str, prompt: list[int], decode: int = 1) -> Any:
    request = sim._make_request(rid, prompt, SimpleNamespace(decode_len=decode))
    sim.requests[rid] = request
    sim.arrivals.out_tokens[rid] = [7] * decode
    return request


def _step(sim: Sim) -> None:
    sim.step += 1
    scheduled = sim.scheduler.schedule()
    output = sim._model_output(scheduled, sim.workers.output(scheduled, sim.step))
    sim.scheduler.update_from_output(scheduled, output)
    sim.view.mgr.settle()  # the step's pass runs beside the model


def _chunk_keys(request: Any, chunks: int) -> list[bytes]:
    per_chunk = CHUNK_TOKENS // BLOCK_TOKENS
    return [bytes(request.block_hashes[(c + 1) * per_chunk - 1]) for c in range(chunks)]


def test_a_big_hit_does_not_reallocate_buffered_blocks_in_its_reach() -> None:
    sim = _sim()
    manager = sim.view.mgr
    a = _add(sim, "a", list(range(1, 513)))
    for n in range(SHORT):
        _add(sim, f"c{n}", [100_000 * (n + 1) + t for t in range(255)],
             decode=8 if n == SHORT - 1 else 1)
    sim.scheduler.add_request(a)
    for n in range(SHORT):
        sim.scheduler.add_request(sim.requests[f"c{n}"])
    _step(sim)
    assert [r.request_id for r in sim.scheduler.running] == [f"c{SHORT - 1}"]
    counters = manager.state.counters
    assert counters[Counter.ADMITTED_OPS] >= 1 and counters[Counter.SUBMITTED_OPS] == 0
    assert counters[Counter.SHIELDED_OPS] == 0  # far beyond the finish-time shield's reach
    a_blocks = set(manager.state.owners)
    queue = [b.block_id for b in sim.pool.free_block_queue.get_all_free_blocks()]
    ranks = sorted(queue.index(block) for block in a_blocks)
    assert ranks[0] < B_HIT_BLOCKS < ranks[-1]  # B's allocation would take some of A's

    b = _add(sim, "b", [7_000_000 + t for t in range(B_HIT_BLOCKS * BLOCK_TOKENS + CHUNK_TOKENS)])
    sim.lm.stored.update(_chunk_keys(b, B_HIT_BLOCKS * BLOCK_TOKENS // CHUNK_TOKENS))
    sim.scheduler.add_request(b)
    _step(sim)  # B's lookup, its allocation, the drain
    taken = {block.block_id for group in sim.scheduler.kv_cache_manager.get_blocks("b").blocks
             for block in group}
    assert len(taken) == B_HIT_BLOCKS
    assert not taken & a_blocks
    assert counters[Counter.DROPPED_EVICTED_OPS] == 0
    assert counters[Counter.LOOKUP_SHIELDED_OPS] == counters[Counter.ADMITTED_OPS]
    assert counters[Counter.SUBMITTED_OPS] == counters[Counter.ADMITTED_OPS]
    for _ in range(5):  # the stores go out with the next step, the receipts wait a pass
        _step(sim)
    assert counters[Counter.STORED_OPS] == counters[Counter.ADMITTED_OPS]
    assert set(_chunk_keys(a, 2)) <= sim.lm.stored
