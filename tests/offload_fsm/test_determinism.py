"""Determinism: the same events give the same decisions, commands and state
digest, step by step, in any state instance and any process (hash seed)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from offload_fsm import Policy, check_all, new_state, state_digest, step
from offload_fsm.digest import canonical_state
from offload_fsm.log.wire import packb
from offload_fsm.vocabulary.decisions import OpsDropped, OpsSelected, StoreSettled, StoreSubmitted
from offload_fsm.vocabulary.events import HashesRead, StepScheduled

from .helpers import random_world_run

REPO = Path(__file__).resolve().parents[2]
ACTIONS = 3000
SEEDS = {Policy.EVICTION_AWARE: 20240611, Policy.FIFO: 7}


@pytest.fixture(scope="module", params=[Policy.EVICTION_AWARE, Policy.FIFO],
                ids=lambda p: p.value)
def recorded(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    policy = request.param
    world = random_world_run(policy, SEEDS[policy], ACTIONS)
    assert world.violations == []
    assert check_all(world.state) == []
    return policy, world


def test_the_random_driver_exercises_the_machine(recorded) -> None:  # type: ignore[no-untyped-def]
    _policy, world = recorded
    events = [event for event, _ in world.applied]
    decisions = [d for _, outcome in world.applied for d in outcome.decisions]
    assert len(events) >= 4000
    assert sum(isinstance(e, StepScheduled) for e in events) > 600
    assert sum(isinstance(e, HashesRead) for e in events) > 20
    for kind in (OpsSelected, StoreSubmitted, StoreSettled, OpsDropped):
        assert any(isinstance(d, kind) for d in decisions), kind.__name__


def test_same_events_give_same_outcomes_and_digests_at_every_step(recorded) -> None:  # type: ignore[no-untyped-def]
    policy, world = recorded
    config = world.state.config
    first = new_state(config, world_size=world.state.world_size)
    second = new_state(config, world_size=world.state.world_size)
    for index, (event, original) in enumerate(world.applied):
        one = step(first, event)
        two = step(second, event)
        assert one == two == original, f"{policy.value} event #{index}: {event!r}"
        assert state_digest(first) == state_digest(second), f"event #{index}: {event!r}"
    assert state_digest(first) == state_digest(world.state)


def _digest_in_subprocess(policy: Policy, hash_seed: str) -> str:
    script = (
        "from offload_fsm import Policy, state_digest\n"
        "from tests.offload_fsm.helpers import random_world_run\n"
        f"world = random_world_run(Policy.{policy.name}, {SEEDS[policy]}, {ACTIONS})\n"
        "assert world.violations == []\n"
        "print(state_digest(world.state), len(world.applied))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env,
                          capture_output=True, text=True, check=False, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_streamed_digest_is_the_digest_of_the_whole_canonical_state(recorded) -> None:  # type: ignore[no-untyped-def]
    """``state_digest`` packs the canonical state a part (and a large part an
    item) at a time; the bytes must be exactly what packing it whole gives,
    or every recorded log's digests stop verifying."""
    policy, world = recorded
    state = new_state(world.state.config, world_size=world.state.world_size)
    seen = {"pins": 0, "claimed_keys": 0, "batches": 0, "requests": 0}
    for index, (event, _) in enumerate(world.applied):
        step(state, event)
        whole = hashlib.blake2b(packb(canonical_state(state)), digest_size=8).hexdigest()
        assert state_digest(state) == whole, f"{policy.value} event #{index}: {event!r}"
        for name in seen:
            seen[name] = max(seen[name], len(getattr(state, name)))
    if policy is Policy.FIFO:
        del seen["claimed_keys"]  # claims are EVICTION_AWARE's
    assert min(seen.values()) > 0, seen  # every streamed part was non-empty somewhere


def test_final_digest_does_not_depend_on_the_hash_seed(recorded) -> None:  # type: ignore[no-untyped-def]
    policy, world = recorded
    here = f"{state_digest(world.state)} {len(world.applied)}"
    assert _digest_in_subprocess(policy, "0") == here
    assert _digest_in_subprocess(policy, "4242") == here
