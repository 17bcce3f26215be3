"""The state digest: a 16-hex-digit fingerprint of everything that can
influence a later decision.

Contract
--------
Two states with the same digest make the same decisions on the same events.
Logs record the digest every so often and at the end; ``replay verify``
recomputes it, so its bytes must never change for a given state: a new part
is appended, and only where the state has it (see the conditional parts).

How it stays complete
---------------------
The digest walks the fields of ``State``, ``RequestState``, ``Op`` and
``Batch`` as the tables below list them. Every attrs field of those classes
is either digested (named in a table, in digest order, with how it is made
canonical) or excluded (named in an ``_EXCLUDED_*`` table with the reason).
A field in neither fails at import, so a new field cannot silently stay out
of the digest (``tests/offload_fsm/test_digest.py`` also checks it).

The large parts (requests, batches, pins, claimed keys) are packed one item
at a time, as msgpack packs a whole array (its header, then each item), so a
digest never builds the part whole: a state's worth of new tuples would set
off the cyclic GC's young collections, on whichever thread the digest runs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import Any, Final, NamedTuple

import attrs
import msgpack

from offload_fsm.state import WIRE_NAME, Batch, Op, RequestState, State
from offload_fsm.vocabulary.counters import FIRST_LATER_COUNTER

__all__ = ["canonical_state", "state_digest"]


class _Items(NamedTuple):
    """A part packed one item at a time (see the module docstring)."""

    length: int
    items: Iterable[Any]


def _value(name: str) -> Callable[[Any], Any]:
    return lambda obj: getattr(obj, name)


def _enum(name: str) -> Callable[[Any], Any]:
    return lambda obj: getattr(obj, name).value


def _keys(name: str) -> Callable[[State], Any]:
    return lambda state: tuple(getattr(state, name))


def _sorted_items(name: str) -> Callable[[State], Any]:
    def part(state: State) -> _Items:
        table = getattr(state, name)
        return _Items(len(table), ((key, table[key]) for key in sorted(table)))
    return part


# Op: what a buffered op is (its request's ops are BUFFERED; a batch lists its
# ops by id, and their status follows the batch's).
_OP_PARTS: Final[tuple[tuple[str, Callable[[Op], Any]], ...]] = tuple(
    (name, _value(name)) for name in ("op_id", "start_token", "end_token", "block_ids",
                                      "block_hashes", "time_s", "blocks_per_chunk", "pinned"))
_EXCLUDED_OP: Final[dict[str, str]] = {
    "req": "a back-reference: the op is digested inside its request",
    "status": "implied by where the op is: a request's buffer or a batch of a given status",
}

_REQUEST_PARTS: Final[tuple[tuple[str, Callable[[RequestState], Any]], ...]] = (
    ("req_id", _value("req_id")),
    ("phase", _enum("phase")),
    ("broken", _value("broken")),
    ("next_start_token", _value("next_start_token")),
    ("order", _value("order")),
    ("batch", lambda rec: rec.batch.batch_id if rec.batch is not None else None),
    ("ops", lambda rec: tuple(tuple(get(op) for _, get in _OP_PARTS) for op in rec.ops)),
)
_EXCLUDED_REQUEST: Final[dict[str, str]] = {
    "stray_receipts": "digested in the lease part, only where a lease is on",
}

_BATCH_PARTS: Final[tuple[tuple[str, Callable[[Batch], Any]], ...]] = (
    ("batch_id", _value("batch_id")),
    ("req", lambda batch: batch.req.req_id),
    ("status", _enum("status")),
    ("receipts", _value("receipts")),
    ("failed", _value("failed")),
    ("orphaned", _value("orphaned")),
    ("ops", lambda batch: tuple(op.op_id for op in batch.ops)),
)
_EXCLUDED_BATCH: Final[dict[str, str]] = {
    "selected_step": "read once, when the batch settles, into State.pin_steps_ema (digested)",
    "selected_time_s": "digested in the lease part, only where a lease is on",
}


def _requests(state: State) -> _Items:
    return _Items(len(state.requests), (tuple(get(rec) for _, get in _REQUEST_PARTS)
                                        for rec in state.requests.values()))


def _batches(state: State) -> _Items:
    return _Items(len(state.batches), (tuple(get(batch) for _, get in _BATCH_PARTS)
                                       for batch in state.batches.values()))


def _counters(state: State) -> tuple[Any, ...]:
    """The base counters by position; later ones by name, once non-zero."""
    values = tuple(state.counters.values())
    base = values[:FIRST_LATER_COUNTER]
    later = tuple(
        (name.value, value)
        for name, value in list(state.counters.items())[FIRST_LATER_COUNTER:]
        if value
    )
    return base + later if later else base


# State, in digest order. A part is one field, except ``stored_keys``: its
# length and ``stored_keys_xor`` (a running fingerprint of its members) stand
# for it, O(1) instead of O(keys).
_STATE_PARTS: Final[tuple[tuple[str, Callable[[State], Any]], ...]] = (
    *((name, _value(name)) for name in (
        "step_index", "ema_blocks", "peak_blocks", "depth_blocks", "next_step_blocks",
        "reserve_blocks", "pin_steps_ema", "time_s", "next_op_id", "next_batch_id",
        "next_order")),
    ("counters", _counters),
    ("requests", _requests),
    ("pending", _keys("pending")),
    ("ready", _keys("ready")),
    ("shielded", _keys("shielded")),
    ("batches", _batches),
    ("pins", _sorted_items("pins")),
    ("stored_keys", lambda state: len(state.stored_keys)),
    ("stored_keys_xor", _value("stored_keys_xor")),
    ("claimed_keys", _sorted_items("claimed_keys")),
    ("closed", _value("closed")),
)


def _lease(state: State) -> tuple[Any, ...]:
    """Lease state, only where a lease is on (logs recorded with it off keep
    their digests)."""
    if state.config.receipt_lease_s <= 0:
        return ()
    return (
        tuple(b.selected_time_s for b in state.batches.values()),
        tuple((r.req_id, r.stray_receipts) for r in state.requests.values() if r.stray_receipts),
    )


def _tail(state: State) -> tuple[Any, ...]:
    """Tail-flush state, only where a flush is on (logs recorded with it off
    keep their digests)."""
    config = state.config
    if config.idle_flush_steps <= 0 and config.shutdown_flush_s <= 0:
        return ()
    return (state.idle_steps, state.shutdown_until_s)


# Appended after the parts above, each only where its setting is on.
_CONDITIONAL_PARTS: Final[dict[str, Callable[[State], tuple[Any, ...]]]] = {
    "lease": _lease,
    "tail": _tail,
}
_CONDITIONAL_FIELDS: Final[dict[str, str]] = {
    "idle_steps": "tail",
    "shutdown_until_s": "tail",
}

_EXCLUDED_STATE: Final[dict[str, str]] = {
    "config": "fixed for a run; the log header carries it",
    "world_size": "fixed for a run; the log header carries it",
    "last_step_tokens": "set from every StepScheduled before it is read",
    "selected_in_step": "reset by every StepScheduled; counts this step's selections",
    "flushed_in_step": "reset by every StepScheduled; counts this step's tail flush",
    "free_blocks": "set from every StepScheduled before it is read",
    "owners": "an index of the digested buffered ops' blocks (EVICTION_AWARE)",
    "owner_hashes": "derived from owners (state.DERIVED)",
    "stored_order": "derived from stored_keys (state.DERIVED)",
    "stored_stale": "derived from stored_keys (state.DERIVED)",
    "live_ops": "derived from the ops' statuses (state.DERIVED)",
    "live_tokens": "derived from the ops' statuses (state.DERIVED)",
    "deadlines": "a heap of the digested buffered ops' times (max_deferral_seconds)",
    "awaiting_hashes": "empty between observations, where digests are taken",
    "awaiting_queue": "false between observations, where digests are taken",
    "context": "None between observations, where digests are taken",
}


def _check_complete(cls: type[Any], digested: Iterable[str], excluded: Iterable[str]) -> None:
    fields = {field.metadata.get(WIRE_NAME, field.name) for field in attrs.fields(cls)}
    named = set(digested) | set(excluded)
    if fields != named:
        raise AssertionError(
            f"offload_fsm.digest: {cls.__name__} fields {sorted(fields - named)} are neither "
            f"digested nor excluded; stale names {sorted(named - fields)}")


def coverage() -> dict[type[Any], tuple[tuple[str, ...], tuple[str, ...]]]:
    """Each digested class: (its fields the digest reads, those it excludes)."""
    return {
        State: (tuple(name for name, _ in _STATE_PARTS) + tuple(_CONDITIONAL_FIELDS),
                tuple(_EXCLUDED_STATE)),
        RequestState: (tuple(name for name, _ in _REQUEST_PARTS), tuple(_EXCLUDED_REQUEST)),
        Op: (tuple(name for name, _ in _OP_PARTS), tuple(_EXCLUDED_OP)),
        Batch: (tuple(name for name, _ in _BATCH_PARTS), tuple(_EXCLUDED_BATCH)),
    }


for _cls, (_digested, _excluded) in coverage().items():
    _check_complete(_cls, _digested, _excluded)


def _parts(state: State) -> tuple[Any, ...]:
    parts = tuple(get(state) for _, get in _STATE_PARTS)
    for conditional in _CONDITIONAL_PARTS.values():
        parts += conditional(state)
    return parts


def canonical_state(state: State) -> tuple[Any, ...]:
    """Everything that can influence a later decision, in a canonical order."""
    return tuple(tuple(part.items) if isinstance(part, _Items) else part
                 for part in _parts(state))


def state_digest(state: State) -> str:
    """A 16-hex-digit fingerprint of :func:`canonical_state`: of the bytes
    msgpack makes of it, packed a part (and a large part an item) at a time."""
    packer = msgpack.Packer(use_bin_type=True)
    parts = _parts(state)
    digest = hashlib.blake2b(packer.pack_array_header(len(parts)), digest_size=8)
    for part in parts:
        if isinstance(part, _Items):
            digest.update(packer.pack_array_header(part.length))
            for item in part.items:
                digest.update(packer.pack(item))
        else:
            digest.update(packer.pack(part))
    return digest.hexdigest()
