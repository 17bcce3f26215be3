"""Wire codec for events, decisions and commands, and the state digest.

A message encodes as a msgpack array ``[TAG, field1, field2, ...]`` in attrs
field order: no field names on the wire, which keeps a typical event to a
few dozen bytes. Tuples travel as arrays and decode back to tuples
(``use_list=False``); enums travel as their string values. Tags are unique
across events (1-99), decisions (100-199) and commands (200-299) and are
never renumbered; a changed field list needs a new schema version and an
upcaster in the log layer.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Iterable
from typing import Any, NamedTuple

import attrs
import msgpack

from offload_fsm.commands import COMMAND_TYPES, Command
from offload_fsm.counters import FIRST_LATER_COUNTER
from offload_fsm.decisions import DECISION_TYPES, Decision
from offload_fsm.errors import LogCorrupt, UnknownTag
from offload_fsm.events import EVENT_TYPES, Event
from offload_fsm.state import State

Message = Event | Decision | Command

_TYPES: dict[int, type[Any]] = {}
for _cls in (*EVENT_TYPES, *DECISION_TYPES, *COMMAND_TYPES):
    assert _cls.TAG not in _TYPES, f"duplicate wire tag {_cls.TAG}"
    _TYPES[_cls.TAG] = _cls

def _enum_fields(cls: type[Any]) -> tuple[tuple[int, type[enum.Enum]], ...]:
    # Field types are strings under ``from __future__ import annotations``.
    fields = attrs.fields(attrs.resolve_types(cls))
    return tuple(
        (index, field.type)
        for index, field in enumerate(fields)
        if isinstance(field.type, type) and issubclass(field.type, enum.Enum)
    )


_ENUM_FIELDS = {tag: _enum_fields(cls) for tag, cls in _TYPES.items()}
_FIELD_NAMES: dict[int, tuple[str, ...]] = {
    tag: tuple(f.name for f in attrs.fields(cls)) for tag, cls in _TYPES.items()
}


def to_wire(message: Message) -> tuple[Any, ...]:
    """``(TAG, *fields)`` with enums as their values."""
    values = attrs.astuple(message, recurse=False)
    enums = _ENUM_FIELDS[message.TAG]
    if enums:
        listed = list(values)
        for index, _ in enums:
            listed[index] = listed[index].value
        values = tuple(listed)
    return (message.TAG, *values)


def from_wire(item: tuple[Any, ...] | list[Any]) -> Message:
    """Inverse of :func:`to_wire`; raises :class:`UnknownTag` or
    :class:`LogCorrupt` on bad input."""
    if not item:
        raise LogCorrupt("empty message")
    tag = item[0]
    cls = _TYPES.get(tag)
    if cls is None:
        raise UnknownTag(tag)
    values = list(item[1:])
    names = _FIELD_NAMES[tag]
    if len(values) != len(names):
        raise LogCorrupt(
            f"tag {tag} ({cls.__name__}) has {len(values)} fields, expected {len(names)}"
        )
    for index, enum_type in _ENUM_FIELDS[tag]:
        try:
            values[index] = enum_type(values[index])
        except ValueError:
            raise LogCorrupt(f"tag {tag}: bad {names[index]} value {values[index]!r}") from None
    try:
        return cls(**dict(zip(names, values, strict=True)))  # type: ignore[no-any-return]
    except TypeError as error:
        raise LogCorrupt(f"tag {tag}: {error}") from None


def packb(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


def unpackb(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, use_list=False, strict_map_key=False)


def encode(message: Message) -> bytes:
    return packb(to_wire(message))


def decode(data: bytes) -> Message:
    try:
        item = unpackb(data)
    except Exception as error:  # msgpack raises several unrelated types
        raise LogCorrupt(f"undecodable msgpack: {error}") from None
    if not isinstance(item, tuple):
        raise LogCorrupt(f"expected an array, got {type(item).__name__}")
    return from_wire(item)


class _Items(NamedTuple):
    """A part of the canonical state that :func:`state_digest` packs one item
    at a time (as msgpack packs the whole array: its header, then each item),
    so a digest never holds the part whole: a state's worth of new tuples
    would fill the cyclic GC's young generation many times over, and each
    collection it sets off walks whatever else is young (vLLM's requests'
    token lists), on whichever thread the digest runs."""

    length: int
    items: Iterable[Any]


def canonical_state(state: State) -> tuple[Any, ...]:
    """Everything that can influence a later decision, in a canonical order."""
    return tuple(tuple(part.items) if isinstance(part, _Items) else part
                 for part in _canonical_parts(state))


def _canonical_parts(state: State) -> tuple[Any, ...]:
    """:func:`canonical_state` with its large parts as :class:`_Items`."""
    requests = _Items(len(state.requests), (
        (
            rec.req_id,
            rec.phase.value,
            rec.broken,
            rec.next_start_token,
            rec.order,
            rec.batch.batch_id if rec.batch is not None else None,
            tuple(
                (op.op_id, op.start_token, op.end_token, op.block_ids, op.block_hashes,
                 op.time_s, op.blocks_per_chunk, op.pinned)
                for op in rec.ops
            ),
        )
        for rec in state.requests.values()
    ))
    batches = _Items(len(state.batches), (
        (b.batch_id, b.req.req_id, b.status.value, b.receipts, b.failed, b.orphaned,
         tuple(op.op_id for op in b.ops))
        for b in state.batches.values()
    ))
    pins, claimed = state.pins, state.claimed_keys
    return (
        state.step_index,
        state.ema_blocks,
        state.peak_blocks,
        state.depth_blocks,
        state.next_step_blocks,
        state.reserve_blocks,
        state.pin_steps_ema,
        state.time_s,
        state.next_op_id,
        state.next_batch_id,
        state.next_order,
        _counters(state),
        requests,
        tuple(state.pending),
        tuple(state.ready),
        tuple(state.shielded),
        batches,
        _Items(len(pins), ((block, pins[block]) for block in sorted(pins))),
        len(state.stored_keys),  # membership by a running fingerprint: O(1), not O(2^18)
        state.stored_keys_xor,
        _Items(len(claimed), ((key, claimed[key]) for key in sorted(claimed))),
        state.poisoned,
        *_lease(state),
        *_tail(state),
    )


def _lease(state: State) -> tuple[Any, ...]:
    """Lease state, only where a lease is on (logs recorded before leases
    existed replay with it off and keep their digests)."""
    if state.config.receipt_lease_s <= 0:
        return ()
    return (
        tuple(b.selected_time_s for b in state.batches.values()),
        tuple((r.req_id, r.stray_receipts) for r in state.requests.values() if r.stray_receipts),
    )


def _tail(state: State) -> tuple[Any, ...]:
    """Tail-flush state, only where a flush is on (logs recorded before it
    existed, or with it off, keep their digests)."""
    config = state.config
    if config.idle_flush_steps <= 0 and config.shutdown_flush_s <= 0:
        return ()
    return (state.idle_steps, state.shutdown_until_s)


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


def state_digest(state: State) -> str:
    """A 16-hex-digit fingerprint of :func:`canonical_state`: of the bytes
    ``packb`` makes of it, packed a part (and a large part an item) at a time."""
    packer = msgpack.Packer(use_bin_type=True)
    parts = _canonical_parts(state)
    digest = hashlib.blake2b(packer.pack_array_header(len(parts)), digest_size=8)
    for part in parts:
        if isinstance(part, _Items):
            digest.update(packer.pack_array_header(part.length))
            for item in part.items:
                digest.update(packer.pack(item))
        else:
            digest.update(packer.pack(part))
    return digest.hexdigest()

