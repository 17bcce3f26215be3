"""Python heap per buffered op in our core (tracemalloc).

Builds a fresh ``offload_fsm`` state, admits ``n`` ops (``requests`` requests,
``blocks_per_op`` blocks each, EVICTION_AWARE so the block->op index is populated),
and reports the traced-heap growth per op, minus the op's block-id tuple (and, in a
second figure, minus the block-hash snapshot tuple too). The block-id and hash tuples
are built *before* the measurement starts and handed to the events, so the diff counts
only what the core itself allocates per op; their sizes are reported separately.

    python -m bench.memory [--ops 5000] [--blocks-per-op 8]
"""

from __future__ import annotations

import argparse
import gc
import sys
import tracemalloc

from offload_fsm import parse_config
from offload_fsm.machine import step
from offload_fsm.state import new_state
from offload_fsm.vocabulary.events import CandidateOffered, RequestArrived


def measure(
    n_ops: int = 5000, blocks_per_op: int = 8, ops_per_request: int = 4
) -> dict[str, float]:
    config = parse_config({"lmcache.mp.lazy_offload": True,
                           "lmcache.mp.lazy_offload_policy": "EVICTION_AWARE"}).offload
    state = new_state(config, world_size=1)
    n_req = (n_ops + ops_per_request - 1) // ops_per_request
    req_ids = [f"req-{i:06d}" for i in range(n_req)]
    events = []
    next_block = 1
    for i, rid in enumerate(req_ids):
        for k in range(ops_per_request):
            if i * ops_per_request + k >= n_ops:
                break
            ids = tuple(range(next_block, next_block + blocks_per_op))
            next_block += blocks_per_op
            hashes = tuple((b * 0x9E3779B97F4A7C15) & ((1 << 64) - 1) for b in ids)
            events.append(CandidateOffered(req_id=rid, start_token=k * 256,
                                           end_token=(k + 1) * 256, block_ids=ids,
                                           block_hashes=hashes, time_s=0.0))
    ids_bytes = sum(sys.getsizeof(e.block_ids) for e in events)
    hash_bytes = sum(sys.getsizeof(e.block_hashes) + sum(sys.getsizeof(h) for h in e.block_hashes)
                     for e in events)
    arrivals = [RequestArrived(req_id=r) for r in req_ids]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for ev in arrivals:
        step(state, ev)
    for ev in events:
        step(state, ev)
    del ev
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    # The events themselves are kept alive by us (the list), not by the core: the core
    # keeps only the tuples, which were allocated before the snapshot.
    buffered = sum(len(r.ops) for r in state.pending.values())
    assert buffered == n_ops, (buffered, n_ops)
    return {
        "ops": n_ops,
        "blocks_per_op": blocks_per_op,
        "heap_growth_bytes": grown,
        "per_op_bytes": grown / n_ops,
        "block_id_tuple_bytes_per_op": ids_bytes / n_ops,
        "hash_tuple_bytes_per_op": hash_bytes / n_ops,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ops", type=int, default=5000)
    ap.add_argument("--blocks-per-op", type=int, default=8)
    a = ap.parse_args(argv)
    r = measure(a.ops, a.blocks_per_op)
    print("memory per buffered op (our core, tracemalloc):")
    for k, v in r.items():
        print(f"  {k}: {v:.1f}" if isinstance(v, float) else f"  {k}: {v}")
    print(f"  => {r['per_op_bytes']:.0f} B of core heap per op beyond its block ids and hash "
          f"snapshot (both allocated by the caller: {r['block_id_tuple_bytes_per_op']:.0f} B + "
          f"{r['hash_tuple_bytes_per_op']:.0f} B); target <= 1024 B")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
