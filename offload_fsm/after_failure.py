"""Drain-only mode: what the shell does once the machine can no longer be
trusted, until every store it handed to LMCache has settled.

A failed step poisons the machine (``machine``), and a failure of the shell
itself leaves it mid-callback; either way nothing new may be submitted, but
LMCache's workers may still be copying the blocks of stores already
submitted, and releasing those blocks early would let vLLM hand them to
another request while they are copied: the stored chunk could then hold
another request's KV under this prefix's key. :class:`DrainOnly` takes over
from the last state and the shell's own records (``take_over``): the stores
it really submitted and the pins it really holds. Not the core's pin count:
a failure between the core's decision and the shell's execution (a
``ProtectBlocks`` that raised, a ``ReleaseBlocks`` that never ran) makes the
two differ, and releasing a block the shell never touched would corrupt
vLLM's reference counts. Then it:

* releases at once every pin of ops LMCache never saw (buffered, verifying,
  shielded);
* keeps the pins of each submitted batch until every worker has reported on
  it, or its receipt lease has run out, then releases them;
* ends every request's session exactly once: a finished request with
  nothing in flight now, any other when it has finished and its batch has
  settled (LMCache's lazy mode ends sessions only through us);
* is :attr:`busy` (vLLM keeps stepping) while anything is in flight.

Pure, like the rest of the core: time arrives as arguments, and every method
returns the commands the shell must execute (``ReleaseBlocks``,
``EndSession``). It is not event-sourced: the log ends at the rejection.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterable, Mapping

import attrs

from offload_fsm.state import Phase, State
from offload_fsm.vocabulary.commands import Command, EndSession, ReleaseBlocks


@attrs.define(kw_only=True)
class _InFlight:
    batch_id: int
    block_ids: tuple[int, ...]
    receipts_due: int
    selected_time_s: float
    finished: bool


@attrs.define(kw_only=True)
class DrainStats:
    released_now_blocks: int = 0  # at take-over: pins of ops LMCache never saw
    kept_blocks: int = 0  # at take-over: pins of submitted batches
    settled_batches: int = 0
    abandoned_batches: int = 0  # lease ran out
    sessions_ended: int = 0


class DrainOnly:
    """See the module docstring."""

    def __init__(self, *, world_size: int, lease_s: float) -> None:
        self.world_size = world_size
        self.lease_s = lease_s
        self.in_flight: dict[str, _InFlight] = {}
        self.stats = DrainStats()

    @classmethod
    def take_over(
        cls,
        state: State,
        submitted: Mapping[str, tuple[int, tuple[int, ...]]],
        held_pins: Mapping[int, int],
        now_s: float,
        unexecuted: Iterable[Command] = (),
    ) -> tuple[DrainOnly, list[Command]]:
        """Start from ``state`` (closed or mid-callback), ``submitted`` (request id ->
        (batch id, block ids) of each store the shell handed to LMCache and has
        not seen settle) and ``held_pins`` (block id -> protections the shell
        applied and has not released); ``unexecuted``: commands the core
        emitted but the shell never carried out (``CommandFailed``), whose
        sessions the state already forgot. Returns the machine and the
        commands to execute now."""
        drain = cls(world_size=state.world_size, lease_s=state.config.receipt_lease_s)
        held = Tally({b: n for b, n in held_pins.items() if n > 0})
        keep: Tally[int] = Tally()
        for req_id, (batch_id, block_ids) in submitted.items():
            rec = state.requests.get(req_id)
            batch = state.batches.get(batch_id)
            mine = Tally(block_ids) & (held - keep)  # never keep a pin we do not hold
            keep += mine
            drain.in_flight[req_id] = _InFlight(
                batch_id=batch_id,
                block_ids=tuple(mine.elements()),
                receipts_due=state.world_size - (batch.receipts if batch is not None else 0),
                selected_time_s=batch.selected_time_s if batch is not None else now_s,
                finished=rec is None or rec.phase is Phase.FINISHED,
            )
        commands: list[Command] = []
        release = held - keep
        if release:
            commands.append(ReleaseBlocks(batch_id=-1, block_ids=tuple(sorted(release.elements()))))
        drain.stats.released_now_blocks = sum(release.values())
        drain.stats.kept_blocks = sum(keep.values())
        ending = [c.req_id for c in unexecuted if isinstance(c, EndSession)]
        ending += [r for r, rec in state.requests.items() if rec.phase is Phase.FINISHED]
        for req_id in dict.fromkeys(ending):
            entry = drain.in_flight.get(req_id)
            if entry is not None:
                entry.finished = True
            else:
                commands.append(drain._end(req_id))
        return drain, commands

    @property
    def busy(self) -> bool:
        return bool(self.in_flight)

    def receipts(self, completed: Mapping[str, int], failed: Iterable[str] = ()) -> list[Command]:
        """Workers reported (a failure comes with its completion count)."""
        commands: list[Command] = []
        for req_id, count in completed.items():
            entry = self.in_flight.get(req_id)
            if entry is None or count < 1:
                continue
            entry.receipts_due -= count
            if entry.receipts_due <= 0:
                self.stats.settled_batches += 1
                commands += self._settle(req_id)
        return commands

    def finished(self, req_id: str) -> list[Command]:
        entry = self.in_flight.get(req_id)
        if entry is not None:
            entry.finished = True
            return []
        return [self._end(req_id)]

    def arrived(self, req_id: str) -> None:
        """An id came back: its session now ends with its new finish."""
        entry = self.in_flight.get(req_id)
        if entry is not None:
            entry.finished = False

    def step(self, now_s: float) -> list[Command]:
        """A scheduler step at ``now_s``: batches past their lease are let go."""
        if self.lease_s <= 0:
            return []
        expired = [r for r, e in self.in_flight.items()
                   if now_s - e.selected_time_s >= self.lease_s]
        commands: list[Command] = []
        for req_id in expired:
            self.stats.abandoned_batches += 1
            commands += self._settle(req_id)
        return commands

    def shutdown(self) -> list[Command]:
        """vLLM is stopping: let everything go, end what finished."""
        commands: list[Command] = []
        for req_id in list(self.in_flight):
            self.stats.abandoned_batches += 1
            commands += self._settle(req_id)
        return commands

    def _settle(self, req_id: str) -> list[Command]:
        entry = self.in_flight.pop(req_id)
        commands: list[Command] = []
        if entry.block_ids:
            commands.append(ReleaseBlocks(batch_id=entry.batch_id, block_ids=entry.block_ids))
        if entry.finished:
            commands.append(self._end(req_id))
        return commands

    def _end(self, req_id: str) -> EndSession:
        self.stats.sessions_ended += 1
        return EndSession(req_id=req_id)
