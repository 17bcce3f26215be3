"""Read-only invariant checkers over a :class:`State`.

Each checker returns a list of violation strings (empty when it holds), so
tests can assert on it and replay can report it. :func:`check_all` runs them
all; :func:`assert_invariants` raises.

The invariants:

* ``ledger_closes``: admitted == pending + verifying + in_flight + stored +
  failed + abandoned + sum(dropped_*), in ops and in tokens.
* ``pins_balance``: the per-block protection count equals the blocks of the
  ops marked pinned, and protected - released == protections held.
* ``one_batch_per_request``: each batch belongs to exactly one request, which
  points back at it.
* ``front_slices``: a request's buffered ops are contiguous in token order and
  its current-generation batch ends where its buffer starts (what was
  selected is a contiguous front slice).
* ``quiet_on_empty_steps``: nothing was selected on a zero-token step, except
  by a configured tail flush (``tail_flush``): after ``idle_flush_steps``
  consecutive empty steps, or inside the shutdown wait.
* ``verified_before_submit``: every in-flight op passed its hash check (the
  check itself is the ``HashesRead`` handler; submitted ops carry no other
  path into ``IN_FLIGHT``).
* ``indexes_agree``: the pending/ready/shielded/owner (and owner hash) indexes match the
  buffers.
* ``statuses_agree``: every op's status matches its container (buffered ops
  BUFFERED, a batch's ops its batch's status).
* ``live_tallies_agree``: ``State.live_ops``/``live_tokens`` (kept by
  ``legality.move``, admissions and splits) count the ops in the containers.
"""

from __future__ import annotations

from collections import Counter as Tally
from typing import Final

from offload_fsm.state import (
    BatchStatus,
    Holders,
    OpStatus,
    Phase,
    State,
    holders,
    live_of,
    owner_hashes_of,
)
from offload_fsm.vocabulary.config import Policy
from offload_fsm.vocabulary.counters import DROPPED_OPS, DROPPED_TOKENS, Counter

# unit -> (admitted, {settled term: counter}, {drop cause: counter})
_UNITS: Final = {
    "ops": (Counter.ADMITTED_OPS,
            {"stored": Counter.STORED_OPS, "failed": Counter.FAILED_OPS,
             "abandoned": Counter.ABANDONED_OPS},
            DROPPED_OPS),
    "tokens": (Counter.ADMITTED_TOKENS,
               {"stored": Counter.STORED_TOKENS, "failed": Counter.FAILED_TOKENS,
                "abandoned": Counter.ABANDONED_TOKENS},
               DROPPED_TOKENS),
}


def ledger_terms(state: State, unit: str = "ops") -> dict[str, int]:
    """The ledger's right-hand terms, live ones derived from the buffers."""
    def size(ops: list) -> int:  # type: ignore[type-arg]
        return len(ops) if unit == "ops" else sum(op.tokens for op in ops)

    verifying = in_flight = 0
    for batch in state.batches.values():
        if batch.status is BatchStatus.VERIFYING:
            verifying += size(batch.ops)
        else:
            in_flight += size(batch.ops)
    terms = {
        "pending": sum(size(rec.ops) for rec in state.requests.values()),
        "verifying": verifying,
        "in_flight": in_flight,
    }
    counters = state.counters
    _, settled, dropped = _UNITS[unit]
    for name, counter in settled.items():
        terms[name] = counters[counter]
    for cause, counter in dropped.items():
        terms[f"dropped_{cause.value}"] = counters[counter]
    return terms


def ledger_closes(state: State) -> list[str]:
    problems = []
    for unit in ("ops", "tokens"):
        terms = ledger_terms(state, unit)
        admitted = state.counters[_UNITS[unit][0]]
        if admitted != sum(terms.values()):
            problems.append(f"ledger ({unit}): admitted {admitted} != {terms}")
    return problems


def pins_balance(state: State) -> list[str]:
    expected: Tally[int] = Tally()
    for rec in state.requests.values():
        for op in rec.ops:
            if op.pinned:
                expected.update(op.block_ids)
    for batch in state.batches.values():
        for op in batch.ops:
            if not op.pinned:
                return [f"batch {batch.batch_id} holds an unpinned op {op.op_id}"]
            expected.update(op.block_ids)
    problems = []
    if dict(expected) != state.pins:
        problems.append(f"pins {state.pins} != pinned ops' blocks {dict(expected)}")
    held = sum(state.pins.values())
    counters = state.counters
    protected, released = counters[Counter.PROTECTED_BLOCKS], counters[Counter.RELEASED_BLOCKS]
    if protected - released != held:
        problems.append(f"protected {protected} - released {released} != held {held}")
    return problems


def one_batch_per_request(state: State) -> list[str]:
    problems = []
    owners: Tally[str] = Tally()
    for batch_id, batch in state.batches.items():
        owners[batch.req.req_id] += 1
        if batch.batch_id != batch_id or batch.req.batch is not batch:
            problems.append(f"batch {batch_id} and request {batch.req.req_id} disagree")
        if state.requests.get(batch.req.req_id) is not batch.req:
            problems.append(f"batch {batch_id} belongs to a forgotten request")
    problems += [f"request {r} has {n} batches" for r, n in owners.items() if n > 1]
    return problems


def front_slices(state: State) -> list[str]:
    problems = []
    for rec in state.requests.values():
        for before, after in zip(rec.ops, rec.ops[1:], strict=False):
            if before.end_token != after.start_token:
                problems.append(f"request {rec.req_id}: buffered ops are not contiguous")
        batch = rec.batch
        if batch is not None:
            for before, after in zip(batch.ops, batch.ops[1:], strict=False):
                if before.end_token != after.start_token:
                    problems.append(f"request {rec.req_id}: batch ops are not contiguous")
            if not batch.orphaned and rec.ops and batch.ops[-1].end_token != rec.ops[0].start_token:
                problems.append(f"request {rec.req_id}: batch is not the front slice")
    return problems


def quiet_on_empty_steps(state: State) -> list[str]:
    if state.last_step_tokens != 0:
        return []
    problems = []
    other = state.selected_in_step - state.flushed_in_step
    if other:
        problems.append(f"{other} ops selected on a zero-token step, not by the tail flush")
    limit = state.config.idle_flush_steps
    idle_due = limit > 0 and state.idle_steps >= limit
    if state.flushed_in_step and not idle_due and state.shutdown_until_s is None:
        problems.append(f"{state.flushed_in_step} ops flushed before {limit} idle steps "
                        f"({state.idle_steps}) and outside a shutdown wait")
    return problems


def verified_before_submit(state: State) -> list[str]:
    return [
        f"batch {batch.batch_id} is in flight without a hash check"
        for batch in state.batches.values()
        if batch.status is BatchStatus.IN_FLIGHT and batch.batch_id in state.awaiting_hashes
    ]


def indexes_agree(state: State) -> list[str]:
    problems = []
    pending = [r for r, rec in state.requests.items() if rec.ops]
    if sorted(pending) != sorted(state.pending):
        problems.append(f"pending index {list(state.pending)} != buffers {pending}")
    ready = [
        r for r, rec in state.requests.items()
        if rec.phase is Phase.FINISHED and rec.ops and rec.batch is None
    ]
    if sorted(ready) != sorted(state.ready):
        problems.append(f"ready index {list(state.ready)} != {ready}")
    shielded = [r for r, rec in state.requests.items() if any(op.pinned for op in rec.ops)]
    if sorted(shielded) != sorted(state.shielded):
        problems.append(f"shielded index {list(state.shielded)} != {shielded}")
    if state.config.policy is Policy.EVICTION_AWARE:
        owners: dict[int, list[int]] = {}
        for rec in state.requests.values():
            for op in rec.ops:
                for block_id in op.block_ids:
                    owners.setdefault(block_id, []).append(op.op_id)
        indexed = {b: sorted(op.op_id for op in holders(e)) for b, e in state.owners.items()}
        if {b: sorted(v) for b, v in owners.items()} != indexed:
            problems.append("block owner index disagrees with the buffers")
        if state.owner_hashes != owner_hashes_of(state.owners):
            problems.append("owner hash index disagrees with the owners' snapshots")
        for block_id, entry in state.owners.items():
            if type(entry) is Holders and (
                    block_id not in entry.block_ids or len(entry) < 2
                    or any(state.owners.get(b) is not entry for b in entry.block_ids)
                    or entry.block_hashes
                    != tuple(map(state.owner_hashes.get, entry.block_ids))):
                problems.append(f"block {block_id}'s shared holders are not its chunk's "
                                f"({entry.block_ids} -> {sorted(entry)})")
                break
        stale, live = dict(state.stored_stale), []
        for key in state.stored_order:
            if stale.get(key):
                stale[key] -= 1
            else:
                live.append(key)
        if live != list(state.stored_keys) or any(stale.values()):
            problems.append("stored-key order disagrees with the stored keys")
        claimed: Tally[int] = Tally(
            key for batch in state.batches.values() for op in batch.ops for key in op.chunk_keys
        )
        if dict(claimed) != state.claimed_keys:
            problems.append(f"claimed keys {state.claimed_keys} != batches' {dict(claimed)}")
    return problems


_BATCH_OP_STATUS: Final = {
    BatchStatus.VERIFYING: OpStatus.VERIFYING,
    BatchStatus.IN_FLIGHT: OpStatus.IN_FLIGHT,
}


def statuses_agree(state: State) -> list[str]:
    problems = []
    for rec in state.requests.values():
        problems += [f"buffered op {op.op_id} of {rec.req_id!r} is {op.status.value}"
                     for op in rec.ops if op.status is not OpStatus.BUFFERED]
    for batch in state.batches.values():
        want = _BATCH_OP_STATUS[batch.status]
        problems += [f"op {op.op_id} of batch {batch.batch_id} is {op.status.value}, "
                     f"expected {want.value}" for op in batch.ops if op.status is not want]
    return problems


def live_tallies_agree(state: State) -> list[str]:
    ops, tokens = live_of(state)
    if (ops, tokens) == (state.live_ops, state.live_tokens):
        return []
    return [f"live tallies ops {state.live_ops} tokens {state.live_tokens} != "
            f"the buffers' and batches' ops {ops} tokens {tokens}"]


CHECKS = (
    ledger_closes,
    pins_balance,
    one_batch_per_request,
    front_slices,
    quiet_on_empty_steps,
    verified_before_submit,
    indexes_agree,
    statuses_agree,
    live_tallies_agree,
)


def check_all(state: State) -> list[str]:
    return [problem for check in CHECKS for problem in check(state)]


def assert_invariants(state: State) -> None:
    problems = check_all(state)
    if problems:
        raise AssertionError("offload_fsm invariants violated:\n  " + "\n  ".join(problems))
