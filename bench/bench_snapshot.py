"""Cost of a state snapshot (not a timed test).

    .venv/bin/python -m bench.bench_snapshot [--ops 5000] [--requests 500] [--repeat 5]

The recorder takes a snapshot once per log rotation (every
``lmcache.mp.lazy_offload_log_max_file_mib``, 64 MiB by default), and the
engine's hand-off one when it resumes after an outage:
``digest.state_digest`` plus ``log.snapshot.take``. Packing it to msgpack
happens on the writer thread; ``snapshot.restore`` only in ``replay``. This builds a
large state (``--ops`` buffered ops over ``--requests`` running requests,
nothing drained: a FIFO threshold nobody reaches, and an EVICTION_AWARE
state whose blocks are indexed in ``owners``) and prints, per policy, the
median time of each part and the snapshot's packed size.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from offload_fsm.digest import state_digest
from offload_fsm.log import snapshot
from offload_fsm.log.wire import packb, unpackb
from offload_fsm.machine import step
from offload_fsm.state import State, new_state
from offload_fsm.vocabulary.config import OffloadConfig, Policy
from offload_fsm.vocabulary.events import CandidateOffered, RequestArrived


def build(policy: Policy, *, ops: int, requests: int, blocks_per_op: int = 2) -> State:
    config = OffloadConfig(policy=policy, threshold=10**9, select_count=1)
    state = new_state(config, world_size=2)
    per_request = max(1, ops // requests)
    block = 0
    for r in range(requests):
        req_id = f"req-{r}"
        step(state, RequestArrived(req_id=req_id))
        for i in range(per_request):
            ids = tuple(range(block, block + blocks_per_op))
            block += blocks_per_op
            step(state, CandidateOffered(
                req_id=req_id, start_token=i * 64, end_token=(i + 1) * 64, block_ids=ids,
                block_hashes=tuple(b + 1 for b in ids), time_s=0.0, blocks_per_chunk=1))
    buffered = sum(len(rec.ops) for rec in state.requests.values())
    assert buffered == per_request * requests, buffered
    return state


def _median_ms(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000.0


def measure(state: State, repeat: int) -> dict[str, float]:
    wire = snapshot.take(state)
    packed = packb(wire)
    decoded = unpackb(packed)
    assert state_digest(snapshot.restore(decoded, state.config)) == state_digest(state)
    return {
        "ops": sum(len(rec.ops) for rec in state.requests.values()),
        "digest_ms": _median_ms(lambda: state_digest(state), repeat),
        "take_ms": _median_ms(lambda: snapshot.take(state), repeat),
        "pack_ms": _median_ms(lambda: packb(wire), repeat),
        "restore_ms": _median_ms(lambda: snapshot.restore(decoded, state.config), repeat),
        "kib": len(packed) / 1024,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", type=int, default=5000)
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(f"{'policy':<16}{'ops':>7}{'digest ms':>11}{'take ms':>12}{'scheduler ms':>14}"
          f"{'pack ms':>9}{'restore ms':>14}{'KiB':>8}")
    for policy in Policy:
        state = build(policy, ops=args.ops, requests=args.requests)
        row = measure(state, args.repeat)
        print(f"{policy.value:<16}{row['ops']:>7}{row['digest_ms']:>11.2f}"
              f"{row['take_ms']:>12.2f}{row['digest_ms'] + row['take_ms']:>14.2f}"
              f"{row['pack_ms']:>9.2f}{row['restore_ms']:>14.2f}{row['kib']:>8.0f}")
    print("scheduler ms = digest + take: the scheduler thread's cost, once per rotation")


if __name__ == "__main__":
    main()
