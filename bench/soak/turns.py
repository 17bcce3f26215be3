"""Arms that take turns (``--interleave S``): every arm's server up at once, and the
traffic let through to one arm at a time, for ``S`` seconds each, round after round.

Contract. Each arm's run calls :meth:`Turns.arrive` once its servers are up; it
returns when every arm has arrived (or raises ``threading.BrokenBarrierError`` if
one failed first), and the first arm through starts the round-robin. Each arm's
:class:`~bench.soak.traffic.Traffic` waits on its arm's :meth:`gate` before each
request; after the last turn every gate stays open, so the clients reach their
deadline and stop.

Theory of operation. Sequential arms on one box meet different hours: the model's time
on this box moves by up to 15 % between two arms run one after the other, as much as the
gap being measured. Turns of seconds spread that drift over every arm alike, and each
arm's engine stays warm between its turns. A request started just before a turn ends
finishes in the next arm's turn, so the engines overlap by one request at most, under
a second against turns of tens of seconds. Each arm keeps its own clients, sessions and
random stream, so the traffic of each arm is the same as in a run of its own.
"""

from __future__ import annotations

import threading
import time


class Turns:
    """The round-robin of ``arms``, ``segment_s`` each, for ``open_s`` per arm."""

    def __init__(self, arms: list[str], segment_s: float, open_s: float) -> None:
        if segment_s <= 0:
            raise ValueError(f"--interleave {segment_s!r}: expected seconds > 0")
        self.arms = list(arms)
        self.segment_s = segment_s
        self.wall_s = open_s * len(self.arms)  # every arm's open time, end to end
        self._gates = {arm: threading.Event() for arm in self.arms}
        self._ready = threading.Barrier(len(self.arms))

    def gate(self, arm: str) -> threading.Event:
        return self._gates[arm]

    def arrive(self, timeout_s: float = 1800.0) -> None:
        if self._ready.wait(timeout=timeout_s) == 0:
            threading.Thread(target=self._rotate, name="soak-turns", daemon=True).start()

    def abort(self) -> None:
        """An arm failed before it arrived: the others stop waiting for it."""
        self._ready.abort()

    def _rotate(self) -> None:
        end = time.monotonic() + self.wall_s
        turn = 0
        while (left := end - time.monotonic()) > 0:
            current = self.arms[turn % len(self.arms)]
            for arm, gate in self._gates.items():  # closed first: one open at a time
                if arm != current:
                    gate.clear()
            self._gates[current].set()
            time.sleep(min(self.segment_s, left))
            turn += 1
        for gate in self._gates.values():
            gate.set()
