"""The tables of one snapshot walk, and ``State.owners``' flat codec.

Pure module: standard library only (and the state's ``Op`` class).

* :class:`Encoding` / :class:`Decoding`: a walk's tables of shared objects
  (``log.snapshot``'s "Identity"): each object met is given its index in its
  class's table once, and every reference to it is that index.
* ``State.owners`` (block id -> its op, or a dict of its ops by id) is the
  biggest part of a busy state. Snapshot format 2 sends it as four flat
  tuples of ints (:func:`encode_owners`), where the generic codec built a
  pair and a tagged alternative per block. Those tuples, built by the log
  writer's thread for each periodic snapshot of a busy state, set off
  collections of the cyclic GC (full ones among them) on the heap vLLM's
  scheduler thread shares; the flat form is four tuples whatever the size.
  Format 1 snapshots decode with the generic codec (:func:`owners_decoder`).
* A field's wire name (:func:`wire_names`) and the codec of an op's packed
  ints (:func:`packed_ints_codec`): on the wire, the tuples they pack.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from offload_fsm.state import WIRE_NAME, Op, pack_ints, unpack_ints
from offload_fsm.vocabulary.errors import LogCorrupt

Owners = dict[int, Op | dict[int, Op]]


class Encoding:
    """One walk: the tables of shared objects (of the classes ``shared``) met so far."""

    __slots__ = ("index", "tables")

    def __init__(self, shared: tuple[type[Any], ...]) -> None:
        self.index: dict[int, int] = {}  # id(obj) -> its index in its class's table
        self.tables: dict[type[Any], list[Any]] = {cls: [] for cls in shared}

    def ref(self, obj: Any) -> int:
        found = self.index.get(id(obj))
        if found is not None:
            return found
        table = self.tables[type(obj)]
        self.index[id(obj)] = index = len(table)
        table.append(obj)
        return index


class Decoding:
    """One rebuild: every table's objects (allocated, filled in turn), and the
    snapshot format being read."""

    __slots__ = ("tables", "version")

    def __init__(self, tables: dict[type[Any], list[Any]], version: int) -> None:
        self.tables = tables
        self.version = version


def ref(value: Any, encoding: Encoding) -> int:
    found = encoding.index.get(id(value))
    return found if found is not None else encoding.ref(value)


def refs(values: Any, encoding: Encoding) -> tuple[int, ...]:
    get, new = encoding.index.get, encoding.ref
    out = []
    for value in values:
        found = get(id(value))
        out.append(found if found is not None else new(value))
    return tuple(out)


def encode_owners(owners: Owners, encoding: Encoding) -> tuple[tuple[int, ...], ...]:
    """``(blocks, counts, keys, refs)``: the block ids in order; for each, 0
    (one op) or how many ops its dict holds; then, in order, each op's key
    (its dict key, or its id) and its index in the op table."""
    counts: list[int] = []
    keys: list[int] = []
    indexes: list[int] = []
    for entry in owners.values():
        if isinstance(entry, Op):
            counts.append(0)
            keys.append(entry.op_id)
            indexes.append(ref(entry, encoding))
            continue
        counts.append(len(entry))
        keys.extend(entry)
        indexes.extend(refs(entry.values(), encoding))
    return tuple(owners), tuple(counts), tuple(keys), tuple(indexes)


def owners_decoder(generic: Callable[[Any, Decoding], Any] | None
                   ) -> Callable[[Any, Decoding], Owners]:
    """The inverse of :func:`encode_owners`; ``generic`` decodes format 1."""
    assert generic is not None

    def decode(value: Any, decoding: Decoding) -> Owners:
        if decoding.version == 1:
            return generic(value, decoding)  # type: ignore[no-any-return]
        blocks, counts, keys, indexes = value
        ops = decoding.tables[Op]
        owners: Owners = {}
        at = 0
        for block_id, count in zip(blocks, counts, strict=True):
            if count == 0:
                owners[block_id] = ops[indexes[at]]
                at += 1
                continue
            owners[block_id] = {keys[i]: ops[indexes[i]] for i in range(at, at + count)}
            at += count
        if at != len(indexes) or len(keys) != len(indexes):
            raise LogCorrupt(f"snapshot: State.owners names {at} holders, its keys "
                             f"{len(keys)} and its refs {len(indexes)}")
        return owners

    return decode


def wire_names(fields: list[Any]) -> dict[str, Any]:
    """attrs ``fields`` by their names on the wire (a field's ``WIRE_NAME``
    metadata, or its own)."""
    return {f.metadata.get(WIRE_NAME, f.name): f for f in fields}


def packed_ints_codec(where: str) -> tuple[Callable[[Any, Any], Any], Callable[[Any, Any], Any]]:
    """Encoder and decoder of a field of packed ints (``state.pack_ints``)."""
    def decode(value: Any, _: Any) -> bytes:
        try:
            return pack_ints(value)
        except (TypeError, OverflowError):
            raise LogCorrupt(f"snapshot: {where} holds a value that is no 64-bit integer") from None
    return (lambda value, _: unpack_ints(value)), decode
