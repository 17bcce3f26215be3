"""Two long recorded runs, kept forever: the simulator's EVICTION_AWARE and FIFO
logs (``python -m bench.simulate --scale small --configs 0 --arms "ours EA,ours
FIFO 20/10"``, real vLLM scheduler, recorded on 2026-12-01 before the core was
split into modules). Every outcome check, every recorded digest, the state
digest after *every* event (chained into one SHA-256) and the final counters
must stay identical: a restructuring that changes any decision fails here."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from offload_fsm.codec import state_digest
from offload_fsm.events import Event
from offload_fsm.machine import Outcome
from offload_fsm.state import State
from replay.runner import replay

LOGS = Path(__file__).parents[1] / "data" / "sim_logs"
EXPECTED = json.loads((LOGS / "expected.json").read_text())


@pytest.mark.parametrize("policy", ["ea", "fifo"])
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
    assert result.ok, (result.divergence, result.damage, result.lost)
    assert result.ended_cleanly
    assert result.events_applied == expected["events"]
    assert result.state is not None
    counters = {str(getattr(k, "value", k)): v for k, v in result.state.counters.items() if v}
    assert counters == expected["counters"]
    assert sampled == expected["digests_every_250"]
    assert chain.hexdigest() == expected["digest_chain_sha256"]
