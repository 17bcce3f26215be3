"""Read-only invariant checkers over a :class:`State`.

Each checker returns a list of violation strings (empty when it holds), so
tests can assert on it, replay can report it, and the connector's debug mode
can log it. :func:`check_all` runs them all; :func:`assert_invariants` raises.

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
* ``quiet_on_empty_steps``: nothing was selected on a zero-token step.
* ``verified_before_submit``: every in-flight op passed its hash check (the
  check itself is the ``HashesRead`` handler; submitted ops carry no other
  path into ``IN_FLIGHT``).
* ``indexes_agree``: the pending/ready/shielded/owner indexes match the
  buffers.
"""

from __future__ import annotations

from collections import Counter

from offload_fsm.config import Policy
from offload_fsm.decisions import DropCause
from offload_fsm.state import BatchStatus, Phase, State, holders


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
    for name in ("stored", "failed", "abandoned"):
        terms[name] = counters[f"{name}_{unit}"]
    for cause in DropCause:
        terms[f"dropped_{cause.value}"] = counters[f"dropped_{cause.value}_{unit}"]
    return terms


def ledger_closes(state: State) -> list[str]:
    problems = []
    for unit in ("ops", "tokens"):
        terms = ledger_terms(state, unit)
        admitted = state.counters[f"admitted_{unit}"]
        if admitted != sum(terms.values()):
            problems.append(f"ledger ({unit}): admitted {admitted} != {terms}")
    return problems


def pins_balance(state: State) -> list[str]:
    expected: Counter[int] = Counter()
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
    if counters["protected_blocks"] - counters["released_blocks"] != held:
        problems.append(
            f"protected {counters['protected_blocks']} - released "
            f"{counters['released_blocks']} != held {held}"
        )
    return problems


def one_batch_per_request(state: State) -> list[str]:
    problems = []
    owners: Counter[str] = Counter()
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
    if state.last_step_tokens == 0 and state.selected_in_step:
        return [f"{state.selected_in_step} ops selected on a zero-token step"]
    return []


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
        claimed: Counter[int] = Counter(
            key for batch in state.batches.values() for op in batch.ops for key in op.chunk_keys
        )
        if dict(claimed) != state.claimed_keys:
            problems.append(f"claimed keys {state.claimed_keys} != batches' {dict(claimed)}")
    return problems


CHECKS = (
    ledger_closes,
    pins_balance,
    one_batch_per_request,
    front_slices,
    quiet_on_empty_steps,
    verified_before_submit,
    indexes_agree,
)


def check_all(state: State) -> list[str]:
    return [problem for check in CHECKS for problem in check(state)]


def assert_invariants(state: State) -> None:
    problems = check_all(state)
    if problems:
        raise AssertionError("offload_fsm invariants violated:\n  " + "\n  ".join(problems))
