"""Which completed batch stored each chunk of content: ``explain``'s memory
for naming who stored what a drop of its request left out or lost.

Contract: :meth:`Storers.observe` takes every decision of the replay, in
order (any request's); :meth:`Storers.duplicate_chain` says, for the content
keys a duplicate drop left out, whose completed batch stored them (or that
they were stored before the replay began, or by a batch it did not see);
:meth:`Storers.all_stored` says whose completed batches stored every one of
some keys, and nothing unless this replay saw each of them stored. Bounded:
at most :data:`STORERS_MAX` keys, oldest forgotten first, as the core's own
memory of stored content; a batch's keys are held from its submission to its
settlement only.
"""

from __future__ import annotations

from typing import Final

from offload_fsm.state import State
from offload_fsm.vocabulary.decisions import StoreAbandoned, StoreSettled, StoreSubmitted
from replay.text import field

STORERS_MAX: Final = 1 << 18  # content keys remembered with their storer (the core's bound)


class Storers:
    """See the module docstring."""

    def __init__(self) -> None:
        self.submitted: dict[int, tuple[str, tuple[int, ...]]] = {}  # batch -> req, content
        self.by_key: dict[int, tuple[str, int, int, int]] = {}  # key -> req, batch, seq, step

    def observe(self, seq: int, decision: object, state: State) -> None:
        kind = type(decision)
        if kind is StoreSubmitted:
            assert isinstance(decision, StoreSubmitted)
            batch = state.batches.get(decision.batch_id)
            if batch is not None:
                self.submitted[decision.batch_id] = (
                    decision.req_id, tuple(k for op in batch.ops for k in op.chunk_keys))
        elif kind is StoreSettled:
            assert isinstance(decision, StoreSettled)
            held = self.submitted.pop(decision.batch_id, None)
            if held is not None and not decision.failed:
                for key in held[1]:
                    self.by_key.pop(key, None)
                    self.by_key[key] = (held[0], decision.batch_id, seq, state.step_index)
                while len(self.by_key) > STORERS_MAX:
                    del self.by_key[next(iter(self.by_key))]
        elif kind is StoreAbandoned:
            assert isinstance(decision, StoreAbandoned)
            self.submitted.pop(decision.batch_id, None)

    def duplicate_chain(self, keys: list[int], first_seq: int) -> list[str]:
        """A duplicate's chain: whose batch stored the ``keys`` it left out;
        ``first_seq``: the first event the replay saw."""
        stores: dict[tuple[str, int], tuple[int, int, int]] = {}
        unknown = 0
        for key in keys:
            storer = self.by_key.get(key)
            if storer is None:
                unknown += 1
                continue
            req_id, batch_id, seq, step = storer
            count = stores.get((req_id, batch_id), (seq, step, 0))[2]
            stores[(req_id, batch_id)] = (seq, step, count + 1)
        chain = [f"{count} chunk(s) stored by request {field(req_id)}, batch {batch_id}: its "
                 f"store COMPLETED (settled at seq {seq}, step {step})"
                 for (req_id, batch_id), (seq, step, count) in stores.items()]
        if unknown:
            chain.append(f"{unknown} chunk(s) stored before seq {first_seq}, where this "
                         "replay began (`explain --no-index` replays from event 0 and names "
                         "the batch)" if first_seq > 0 else
                         f"{unknown} chunk(s) stored by a batch this replay did not see")
        return chain

    def all_stored(self, keys: list[int]) -> list[str]:
        """Whose completed batches stored every one of ``keys``, one line each;
        empty unless this replay saw all of them stored."""
        if not keys or not all(map(self.by_key.__contains__, keys)):
            return []
        return [f"its content was already stored: request {field(req_id)}, batch {batch_id}, "
                f"settled at seq {seq} (step {step})"
                for req_id, batch_id, seq, step in dict.fromkeys(self.by_key[k] for k in keys)]
