"""Two long recorded runs, kept forever: the simulator's EVICTION_AWARE and FIFO
logs (``python -m bench.simulate --scale small --configs 0 --arms "ours EA,ours
FIFO 20/10"``, real vLLM scheduler, recorded on 2026-12-01 before the core was
split into modules). Every outcome check, every recorded digest, the state
digest after *every* event (chained into one SHA-256) and the final counters
must stay identical: a restructuring that changes any decision fails here.

Decisions changed on purpose by a defect fix are listed in
:data:`CHANGED_BY_FIXES`: the recorded run must replay identically up to
that event and diverge exactly there; a later recording of the same
simulation (``sim-ea-2``, recorded on 2026-12-01 with the fixes, same
command) guards the whole run again. ``sim-ea-2`` predates chunk-granularity
selection: its header lacks ``lmcache.mp.lazy_offload_chunk_split``, so it
replays with the rule off, as recorded; ``sim-ea-3`` (same command, recorded
with the rule on) guards the rule."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from offload_fsm.digest import state_digest
from offload_fsm.state import State
from offload_fsm.vocabulary.events import Event
from offload_fsm.vocabulary.outcome import Outcome
from replay.runner import replay

LOGS = Path(__file__).parents[1] / "data" / "sim_logs"
EXPECTED = json.loads((LOGS / "expected.json").read_text())

# policy -> (seq of the first outcome a defect fix changed, why).
CHANGED_BY_FIXES: dict[str, tuple[int, str]] = {
    # Content dedup left a hole in a follower's chain. In the step of seq 778 the
    # recording trimmed s28t0's [0, 2304) as a DUPLICATE of s58t0's batch 2,
    # which was still in flight, and selected only [2304, 2560): had batch 2
    # failed, LMCache could never have reached s28t0's last chunk. The fix
    # trims only chunks confirmed stored, so s28t0 now selects [0, 2560)
    # itself. Defect 2 (the pin budget charged a block shared by two
    # selections twice) alone would first change seq 830: the recording held
    # s84t0, s83t1, s67t0 and s10t0 for PIN_BUDGET, charged again and again
    # for the prefix blocks they share; counted once, all fit in that drain.
    "ea": (778, "a chunk only claimed by a batch in flight is no longer trimmed"),
}


@pytest.mark.parametrize("policy", ["ea", "fifo", "ea-2", "ea-3"])
def test_recorded_simulator_run_replays_identically(policy: str) -> None:
    expected = EXPECTED[policy]
    chain = hashlib.sha256()
    sampled: dict[str, str] = {}

    def observe(seq: int, event: Event, outcome: Outcome, state: State) -> None:
        digest = state_digest(state)
        chain.update(digest.encode())
        if seq % 250 == 0:
            sampled[str(seq)] = digest

    result = replay(LOGS / f"sim-{policy}", observer=observe)
    if policy in CHANGED_BY_FIXES:
        seq, why = CHANGED_BY_FIXES[policy]
        assert result.divergence is not None, f"the fix ({why}) no longer changes seq {seq}"
        assert (result.divergence.seq, result.divergence.kind) == (seq, "outcome"), why
        assert not result.damage and not result.lost
        assert sampled == {k: v for k, v in expected["digests_every_250"].items()
                           if int(k) < seq}
        return
    assert result.ok, (result.divergence, result.damage, result.lost)
    assert result.ended_cleanly
    assert result.events_applied == expected["events"]
    assert result.state is not None
    counters = {str(getattr(k, "value", k)): v for k, v in result.state.counters.items() if v}
    assert counters == expected["counters"]
    assert sampled == expected["digests_every_250"]
    assert chain.hexdigest() == expected["digest_chain_sha256"]
