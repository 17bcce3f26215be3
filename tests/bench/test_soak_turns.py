"""``bench.soak.turns``: one arm's gate open at a time, in order, every gate open
after the last turn, and a failed arm releases the others."""

from __future__ import annotations

import threading
import time

import pytest

from bench.soak.turns import Turns


def test_one_gate_open_at_a_time_in_turn_then_all() -> None:
    turns = Turns(["a", "b"], segment_s=0.4, open_s=0.8)  # 1.6 s: a, b, a, b
    arrivals = [threading.Thread(target=turns.arrive) for _ in range(2)]
    for thread in arrivals:
        thread.start()
    for thread in arrivals:
        thread.join(5)
    seen: list[str] = []
    end = time.monotonic() + 1.4
    while time.monotonic() < end:
        open_ = [arm for arm in ("a", "b") if turns.gate(arm).is_set()]
        assert len(open_) <= 1, open_
        if open_ and (not seen or seen[-1] != open_[0]):
            seen.append(open_[0])
        time.sleep(0.01)
    assert seen[0] == "a" and len(seen) >= 2, seen  # consecutive turns differ by construction
    time.sleep(0.6)
    assert turns.gate("a").is_set() and turns.gate("b").is_set()


def test_an_arm_that_fails_before_it_arrives_releases_the_others() -> None:
    turns = Turns(["a", "b"], segment_s=1.0, open_s=1.0)
    errors: list[BaseException] = []

    def arrive() -> None:
        try:
            turns.arrive(timeout_s=10)
        except threading.BrokenBarrierError as error:
            errors.append(error)

    waiting = threading.Thread(target=arrive)
    waiting.start()
    time.sleep(0.1)
    turns.abort()
    waiting.join(5)
    assert not waiting.is_alive() and len(errors) == 1


def test_a_turn_of_no_time_is_refused() -> None:
    with pytest.raises(ValueError, match="--interleave 0"):
        Turns(["a"], segment_s=0, open_s=60)
