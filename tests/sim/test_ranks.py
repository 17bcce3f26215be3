"""World size 2 in the scheduler-in-the-loop simulator (real vLLM scheduler and block
pool, our connector, simulated workers): the two ranks report every store separately,
rank 1 three steps after rank 0, and rank 1's part of a store fails for some batches.

Checked for both policies: every batch got both receipts before it settled (nothing in
flight at the end, no ignored receipt), failed batches are counted and were not
stored, pins balance (protected == released, nothing held), the ledger closes, and no
store read blocks that no longer held its request's content, neither at submission
nor when its last rank reported (the pins must hold the blocks until then).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from testkit.env import require_stack

require_stack()  # skips without vLLM and LMCache; fails under CI=true

from bench.sim.arms import ArmSpec, SimParams  # noqa: E402
from bench.sim.loop import Sim  # noqa: E402
from bench.sim.workload import WorkloadParams, generate  # noqa: E402

WORKLOAD = WorkloadParams(name="ranks", seed=3, n_chat=10, n_agent=0, n_burst=0,
                          arrival_window_steps=30, chat_turns=(2, 3))
PARAMS = SimParams(num_gpu_blocks=200, max_num_seqs=8, world_size=2,
                   receipt_delay_steps=1, rank_delay_steps=(0, 3),
                   rank_failure_rate=(0.0, 0.5), seed=1, max_steps=5000)
POLICIES = {
    "eviction_aware": {"lmcache.mp.lazy_offload_policy": "EVICTION_AWARE"},
    "fifo": {"lmcache.mp.lazy_offload_policy": "FIFO", "lmcache.mp.lazy_offload_threshold": 1},
}


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_two_ranks_one_late_one_failing(policy: str, tmp_path: Path) -> None:
    from offload_fsm.invariants import check_all, ledger_closes, pins_balance
    from offload_fsm.queries import has_in_flight
    from offload_fsm.vocabulary.counters import Counter

    extra: dict[str, Any] = {"lmcache.mp.lazy_offload": True, **POLICIES[policy]}
    arm = ArmSpec(name=policy, kind="ours", extra=tuple(extra.items()))
    sim = Sim(arm, generate(WORKLOAD), PARAMS, log_dir=str(tmp_path))
    mgr = sim.view.mgr
    t0 = time.perf_counter()
    sim._loop()
    print(policy, "steps", sim.step, "s", round(time.perf_counter() - t0, 1))
    state = mgr.state
    counters = {str(k): v for k, v in state.counters.items() if v}
    # The sim's own books: every store got both receipts, none is outstanding.
    assert not sim.workers.due_receipts and not sim.workers.rank_reports, counters
    assert not has_in_flight(state), counters
    assert state.counters[Counter.SUBMITTED_OPS] > 0, counters
    assert state.counters[Counter.FAILED_OPS] > 0, counters  # rank 1 failed some
    assert state.counters[Counter.STORED_OPS] > 0, counters
    assert state.counters[Counter.RECEIPTS_IGNORED] == 0, counters
    assert ledger_closes(state) == [], counters
    assert pins_balance(state) == [], counters
    assert check_all(state) == [], counters
    assert state.counters[Counter.PROTECTED_BLOCKS] == state.counters[Counter.RELEASED_BLOCKS]
    assert not state.pins
    assert sim.workers.stale_submits == [] and sim.workers.stale_completions == []
    # Failed stores never reached the (simulated) server; stored ones did.
    assert sim.truth.written, "nothing stored"
    sim._collect()  # closes the event log
