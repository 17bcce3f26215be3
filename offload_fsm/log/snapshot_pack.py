"""Compact snapshots (schemas 4 and 5): what a SNAPSHOT record's state
carries, and back.

Pure module: standard library and ``msgpack``-friendly tuples only.

* The stored keys (the one big, slowly moving part of the state): a file's
  snapshots after its first carry them as a delta against the snapshot
  before (:func:`compact_snapshot`); so restoring one reads the file's
  snapshots before it, not its events.
* Schema 5: the op records use ``log.compact``'s forms against tables of
  that snapshot alone, in op order: a hash is ``True`` when an earlier op
  named the block with that hash, block ids are runs. Ops sharing a prefix
  are the common case (a prefix-cache hit re-offers the blocks of a shared
  system prompt or of a session's earlier turns), and their hashes are most
  of a snapshot's bytes. A schema 4 snapshot (plain op records) expands as it is.

A reader decodes a snapshot only when its state is used (:class:`LazyState`):
``replay verify`` folding through a segment compares the live state with the
snapshot's digest and never needs the state itself, so decoding it there
would be work on verify's hot path for nothing. A chain of lazy states (each keyed
against the one before) is decoded oldest first, without recursion.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from offload_fsm.log import snapshot
from offload_fsm.log.bounds import IdAllowance
from offload_fsm.log.compact import refer, resolve
from offload_fsm.log.runs import Lists, runs, unruns
from offload_fsm.log.wire import pack_array_header, packb
from offload_fsm.state import STORED_KEYS_MAX, State
from offload_fsm.vocabulary.errors import LogCorrupt

__all__ = ["KeysOf", "LazyState", "compact_snapshot", "expand_snapshot", "op_columns",
           "packed_snapshot"]

_KEYS_FIELD: Final = "stored_keys"  # the one big, slowly moving part of a snapshot


def _keys_at(wire: tuple[Any, ...]) -> int:
    names = dict(wire[1])["State"]
    return int(names.index(_KEYS_FIELD))


def op_columns(wire: tuple[Any, ...]) -> tuple[int, int, int]:
    """Where a snapshot's op records are (``wire[at]``), and their block ids
    and hashes fields."""
    fields = dict(wire[1])["Op"]
    order = [name for name, _ in wire[1]]  # State, then each table's class
    return 2 + order.index("Op"), fields.index("block_ids"), fields.index("block_hashes")


def _map_ops(wire: tuple[Any, ...],
             forms: Callable[[tuple[Any, ...], tuple[Any, ...]], tuple[Any, Any]]
             ) -> tuple[Any, ...]:
    """``wire`` with each op record's (block ids, hashes) replaced by ``forms`` of them."""
    at, ids_at, hashes_at = op_columns(wire)
    rows = []
    for row in wire[at]:
        ids, hashes = forms(row[ids_at], row[hashes_at])
        fields = list(row)
        fields[ids_at], fields[hashes_at] = ids, hashes
        rows.append(tuple(fields))
    return (*wire[:at], tuple(rows), *wire[at + 1:])


def _op_compactor(ids_at: int, hashes_at: int) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    """One snapshot's op records, in op order, to their compact forms (the
    module docstring): each call takes the next record."""
    lists, hashes = Lists(), dict[int, Any]()

    def compact(record: tuple[Any, ...]) -> tuple[Any, ...]:
        fields = list(record)
        ids = fields[ids_at]
        fields[ids_at] = runs(ids, lists)
        fields[hashes_at] = refer(ids, fields[hashes_at], hashes)
        return tuple(fields)

    return compact


def _compact_ops(wire: tuple[Any, ...]) -> tuple[Any, ...]:
    at, ids_at, hashes_at = op_columns(wire)
    compact = _op_compactor(ids_at, hashes_at)
    return (*wire[:at], tuple(map(compact, wire[at])), *wire[at + 1:])


def _expand_ops(wire: tuple[Any, ...]) -> tuple[Any, ...]:
    lists = Lists()
    hashes: dict[int, Any] = {}
    allowance = IdAllowance()

    def known(block_id: int) -> Any:
        try:
            return hashes[block_id]
        except KeyError:
            raise LogCorrupt(f"a snapshot op's hash reference to block {block_id}, "
                             "named by no op before") from None

    def forms(items: tuple[Any, ...], refs: tuple[Any, ...]) -> tuple[Any, Any]:
        ids = unruns(items, lists, True, allowance, "a snapshot's Op.block_ids")
        return ids, resolve(ids, refs, hashes, known)

    return _map_ops(wire, forms)


def compact_snapshot(wire: tuple[Any, ...], previous: tuple[Any, ...] | None
                     ) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """``log.snapshot.take`` output with its op records' block ids and hashes
    in compact forms (the module docstring) and its stored keys as
    ``{"front": k, "tail": keys}`` (drop ``k`` from the front of
    ``previous``, the keys of the file's snapshot before, then append
    ``keys``) where they are that; and the keys, for the next one.
    ``previous`` None: the keys are whole."""
    keys = wire[2][_keys_at(wire)]
    return _compact_keys(_compact_ops(wire), previous), keys


def packed_snapshot(state: State, previous: tuple[Any, ...] | None
                    ) -> tuple[bytes, tuple[Any, ...]]:
    """The packed bytes of :func:`compact_snapshot` of
    ``log.snapshot.take(state)`` (the very bytes), and the keys for the
    next one, made a record at a time: each table record is packed (an op's
    compacted first, in op order, as :func:`compact_snapshot` does) as the
    walk makes it, so the tables' tuples are never all alive at once. Built
    whole, a busy state's tables are thousands of young objects for the
    cyclic GC on the heap vLLM's scheduler thread shares, and each snapshot
    would set off young collections there."""
    names = snapshot.names()
    op_fields = dict(names)["Op"]
    compact = _op_compactor(op_fields.index("block_ids"), op_fields.index("block_hashes"))
    packed: dict[str, list[bytes]] = {name: [] for name, _ in names[1:]}

    def emit(cls: type[Any], record: tuple[Any, ...]) -> None:
        if cls.__name__ == "Op":
            record = compact(record)
        packed[cls.__name__].append(packb(record))

    body = snapshot.encode_records(state, emit)
    head = (snapshot.SNAPSHOT_FORMAT, names, body)
    keys = body[_keys_at(head)]
    head = _compact_keys(head, previous)
    parts = [pack_array_header(len(head) + len(packed)), *map(packb, head)]
    for rows in packed.values():
        parts.append(pack_array_header(len(rows)))
        parts.extend(rows)
    return b"".join(parts), keys


def _compact_keys(wire: tuple[Any, ...], previous: tuple[Any, ...] | None
                  ) -> tuple[Any, ...]:
    at = _keys_at(wire)
    body = wire[2]
    keys = body[at]
    if previous is None or not keys or not previous:
        return wire
    try:
        front = previous.index(keys[0])
    except ValueError:
        front = len(previous)
    kept = len(previous) - front
    if keys[:kept] != previous[front:]:
        return wire
    delta = {"front": front, "tail": keys[kept:]}
    return (*wire[:2], (*body[:at], delta, *body[at + 1:]), *wire[3:])


def expand_snapshot(wire: Any, previous: tuple[Any, ...] | None
                    ) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """The inverse of :func:`compact_snapshot` (a schema 4 snapshot, whose op
    records are plain, is one too); raises :class:`LogCorrupt`."""
    try:
        wire = _expand_ops(wire)
        at = _keys_at(wire)
        body = wire[2]
        keys = body[at]
        if not isinstance(keys, dict):
            return wire, keys
        if previous is None:
            raise LogCorrupt("a snapshot's keys refer to an earlier snapshot the file lacks")
        front, tail = keys["front"], keys["tail"]
        if not 0 <= front <= len(previous):
            raise LogCorrupt(f"a snapshot's keys drop {front} of {len(previous)}")
        if len(previous) - front + len(tail) > STORED_KEYS_MAX:
            raise LogCorrupt(f"a snapshot's stored keys: {len(previous) - front} kept and "
                             f"{len(tail)} added, more than a state holds (at most "
                             f"{STORED_KEYS_MAX})")
        keys = (*previous[front:], *tail)
        return (*wire[:2], (*body[:at], keys, *body[at + 1:]), *wire[3:]), keys
    except (KeyError, IndexError, TypeError, ValueError) as error:
        raise LogCorrupt(f"snapshot ops or keys: {error!r}") from None


class LazyState:
    """A SNAPSHOT record's state as read (``raw``: the deflated bytes, or the
    compact tuple), expanded on first use against ``previous``, the file's
    snapshot before (its keys, or its own lazy state; None: none before).
    ``inflate`` turns the bytes into the compact tuple. :meth:`wire` and
    :meth:`keys` raise :class:`LogCorrupt`, every time, for a state that does
    not decode. Equal to another state (lazy or not) with an equal wire tuple."""

    __slots__ = ("_raw", "_previous", "_inflate", "_wire", "_keys", "_error")

    def __init__(self, raw: bytes | tuple[Any, ...],
                 previous: LazyState | KeysOf | tuple[Any, ...] | None,
                 inflate: Callable[[bytes], Any]) -> None:
        self._raw: bytes | tuple[Any, ...] | None = raw
        self._previous = previous
        self._inflate = inflate
        self._wire: tuple[Any, ...] | None = None
        self._keys: tuple[Any, ...] = ()
        self._error = ""

    def wire(self) -> tuple[Any, ...]:
        """The state's ``log.snapshot.take`` tuple."""
        if self._wire is None:
            self._expand()
        assert self._wire is not None
        return self._wire

    def keys(self) -> tuple[Any, ...]:
        """The stored keys the state holds (what the next snapshot's delta is against)."""
        if self._wire is None:
            self._expand()
        return self._keys

    def _expand(self) -> None:
        chain: list[LazyState] = [self]  # the undecoded states back to a decoded one
        while isinstance(chain[-1]._previous, LazyState) and chain[-1]._previous._wire is None:
            chain.append(chain[-1]._previous)
        for state in reversed(chain):
            state._expand_one()

    def _expand_one(self) -> None:
        if self._error:
            raise LogCorrupt(self._error)
        previous = self._previous
        try:
            if isinstance(previous, LazyState | KeysOf):
                previous = previous.keys()
            raw = self._raw
            data = self._inflate(raw) if isinstance(raw, bytes) else raw
            self._wire, self._keys = expand_snapshot(data, previous)
        except LogCorrupt as error:
            self._error = str(error)
            raise
        self._raw = self._previous = None

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LazyState):
            other = other.wire()
        return isinstance(other, tuple) and self.wire() == other

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        state = "decoded" if self._wire is not None else "failed" if self._error else "lazy"
        return f"<LazyState {state}>"


class KeysOf:
    """The stored keys of ``state`` (what a later snapshot of its file is keyed
    against), holding the state only until they are read: a cache of many
    keeps keys, not whole states."""

    __slots__ = ("_state", "_keys")

    def __init__(self, state: LazyState) -> None:
        self._state: LazyState | None = state
        self._keys: tuple[Any, ...] = ()

    def keys(self) -> tuple[Any, ...]:
        if self._state is not None:
            self._keys = self._state.keys()  # raises LogCorrupt, and again next time
            self._state = None
        return self._keys
