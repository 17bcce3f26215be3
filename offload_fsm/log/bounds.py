"""What reading a log may allocate: the bounds on decoding untrusted bytes.

Pure module: standard library and ``msgpack`` only.

A log is untrusted input (operators open logs attached to bug reports), and
its forms expand: zlib inflates, msgpack builds Python objects (up to about
80 bytes of them per byte it reads: an empty map is one byte and a dict),
and the compact forms (``log.compact``) copy earlier lists. Each expansion
is bounded *before* it allocates, and each violation is
:class:`LogCorrupt` naming the field, the value and the bound, which replay
reports as damage (exit 3) like any other:

* A frame's payload: at most ``log.framing.MAX_PAYLOAD_BYTES``; resynchronising
  after damage: CRC work in proportion to the file (``log.framing``).
* zlib: a batch inflates to at most ``log.batch.MAX_BATCH_BYTES``, a
  snapshot's state to at most ``log.decode.inflate_bound`` of its size; bytes
  after a stream's end are damage (a batch's stream never ends, a
  snapshot's ends with its state).
* msgpack: a payload or a batch decodes to at most :data:`MAX_BATCH_OBJECTS`
  objects, a SNAPSHOT (its payload, or its inflated state) to at most
  :data:`MAX_SNAPSHOT_OBJECTS`. Every msgpack object takes at least a byte,
  so bytes no more than the bound decode as they are; longer ones are
  counted (:class:`ObjectBudget`: each array and map as msgpack completes
  it, itself and its items; no one array or map may hold more than the
  bound, so what a refused decode built stays under twice it).
* Compact forms: a window or a block list decodes to at most
  :data:`MAX_POOL_BLOCKS` ids, and the new lists one payload's forms build
  (a batch's records together: its records are decoded before any is used)
  hold at most :data:`MAX_EXPANDED_IDS` ids in all (:class:`IdAllowance`),
  checked before each list is built. A copy of a whole earlier list shares
  it (a tuple's full slice is itself) and is not charged; a block-id run's
  search for its first id in the list it copies is (so their CPU time is
  bounded too). A segment's
  tables of block ids (the last hash of each, the last list holding each)
  hold at most :data:`MAX_POOL_BLOCKS` entries; a snapshot's stored keys at
  most ``state.STORED_KEYS_MAX``, as the core keeps them.
* A snapshot's state (``log.snapshot.restore``): every record of a table
  has its width before any object is made for the table, so no state object
  comes from fewer decoded values than it holds.

So a file of ``n`` bytes costs a reader memory of order ``n``, plus, for the
one batch it holds decoded, its inflated bytes (twice: zlib's and msgpack's
buffer), about 80 bytes x :data:`MAX_BATCH_OBJECTS` of objects and 8 bytes x
:data:`MAX_EXPANDED_IDS` of copied lists, whatever the bytes say. Legitimate
logs stay far inside (the busiest batch of the golden logs: 138,064 objects
and 78,615 expanded ids).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Final

import msgpack

from offload_fsm.vocabulary.errors import LogCorrupt

__all__ = [
    "MAX_BATCH_OBJECTS",
    "MAX_EXPANDED_IDS",
    "MAX_POOL_BLOCKS",
    "MAX_SNAPSHOT_OBJECTS",
    "IdAllowance",
    "ObjectBudget",
    "unpackb",
    "unpacker",
]

MAX_POOL_BLOCKS: Final[int] = 1 << 22
"""The most block ids any list in a log holds (a window, an offered list, an
op's blocks), and the most distinct block ids a segment names: block ids
index the engine's GPU block pool, and no pool is larger than this (an
80 GB GPU holds a few hundred thousand blocks of a 0.5B model's cache)."""

MAX_EXPANDED_IDS: Final[int] = 1 << 23
"""The most block ids the compact forms of one payload (a batch: all its
records) or one snapshot may copy into new lists (64 MiB of references)."""

MAX_BATCH_OBJECTS: Final[int] = 1 << 21
"""The most msgpack objects a batch's records (or one record's payload) may
decode to: a recorder's batch closes at 256 KiB of payloads, about 160,000
objects."""

MAX_SNAPSHOT_OBJECTS: Final[int] = 1 << 23
"""The most msgpack objects a SNAPSHOT's state may decode to: the stored keys
(at most ``state.STORED_KEYS_MAX``) and about four per owned block of the
pool, with room for pools of over a million blocks."""

_MSGPACK_OPTIONS: Final = {"raw": False, "use_list": False, "strict_map_key": False}


class ObjectBudget:
    """Counts the objects msgpack builds for one payload, batch or state
    (``what`` names it in the error) and raises :class:`LogCorrupt` past
    ``limit`` (see the module docstring). Its methods are msgpack's
    ``list_hook`` and ``object_hook`` (:func:`unpackb`, :func:`unpacker`)."""

    __slots__ = ("left", "limit", "what")

    def __init__(self, what: str, limit: int) -> None:
        self.what = what
        self.limit = limit
        self.left = limit

    def array(self, value: tuple[Any, ...]) -> tuple[Any, ...]:
        self.left -= len(value) + 1
        if self.left < 0:
            self._exceeded()
        return value

    def map(self, value: dict[Any, Any]) -> dict[Any, Any]:
        self.left -= 2 * len(value) + 1
        if self.left < 0:
            self._exceeded()
        return value

    def _exceeded(self) -> None:
        raise LogCorrupt(f"{self.what} decodes to more than {self.limit} msgpack objects "
                         "(the bound on one)")


def unpackb(data: bytes, what: str, limit: int) -> Any:
    """``data`` decoded with the log's options into at most ``limit`` objects
    (``what`` names it in the error). Every msgpack object takes at least a
    byte, so ``data`` no longer than ``limit`` decodes uncounted (the common
    case, at C speed). Raises :class:`LogCorrupt` past the bound, and
    msgpack's own errors."""
    if len(data) <= limit:
        return msgpack.unpackb(data, **_MSGPACK_OPTIONS)
    budget = ObjectBudget(what, limit)
    return msgpack.unpackb(data, **_MSGPACK_OPTIONS, max_array_len=limit, max_map_len=limit,
                           list_hook=budget.array, object_hook=budget.map)


def unpacker(raw: bytes, what: str, limit: int) -> msgpack.Unpacker:
    """An unpacker of the log's options fed ``raw``, whose items decode into
    at most ``limit`` objects in all (as :func:`unpackb`)."""
    if len(raw) <= limit:
        out = msgpack.Unpacker(**_MSGPACK_OPTIONS, max_buffer_size=len(raw))
    else:
        budget = ObjectBudget(what, limit)
        out = msgpack.Unpacker(**_MSGPACK_OPTIONS, max_buffer_size=len(raw),
                               max_array_len=limit, max_map_len=limit,
                               list_hook=budget.array, object_hook=budget.map)
    out.feed(raw)
    return out


class IdAllowance:
    """The block ids the compact forms of one payload or snapshot may still
    copy into new lists (:data:`MAX_EXPANDED_IDS` to start)."""

    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left = MAX_EXPANDED_IDS

    def renew(self) -> None:
        """A new payload starts: the whole allowance again."""
        self.left = MAX_EXPANDED_IDS

    def take(self, ids: int, field: str) -> None:
        """Charge a list of ``ids`` block ids about to be built for ``field``;
        raises :class:`LogCorrupt` (before it is built) past either bound."""
        if ids > MAX_POOL_BLOCKS:
            raise LogCorrupt(f"{field}: its copies make {ids} block ids, more than a list "
                             f"of block ids holds (at most {MAX_POOL_BLOCKS})")
        if ids > self.left:
            raise LogCorrupt(f"{field}: its copies make {ids} block ids, past what one "
                             f"record batch may expand to (at most {MAX_EXPANDED_IDS} "
                             f"in all, {self.left} left)")
        self.left -= ids

    def take_lookup(self, steps: int, field: str) -> None:
        """Charge the ``steps`` a block-id run took to find its first id in
        the list it copies (a run's cost is its search as well as its copy);
        raises :class:`LogCorrupt` once the lookups are past the allowance."""
        if steps > self.left:
            raise LogCorrupt(f"{field}: finding its runs' first ids takes {steps} more steps, "
                             f"past what one record batch may expand to (at most "
                             f"{MAX_EXPANDED_IDS} in all, {self.left} left)")
        self.left -= steps


def check_widths(kind: str, width: int, table: Iterable[Sequence[Any]]) -> None:
    """Every record of a snapshot's ``kind`` table has ``width`` values,
    checked before any object is made for it: a record is then at least as
    big decoded as the object it becomes, so a table of empty records cannot
    make objects out of nothing."""
    odd = next((values for values in table if len(values) != width), None)
    if odd is not None:
        raise LogCorrupt(f"snapshot: a {kind} record has {len(odd)} values, expected {width} "
                         "(checked before its table is built)")
