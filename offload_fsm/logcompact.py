"""Schema 4's compact forms: window deltas, hash references, compressed batches.

Pure module: standard library (``zlib``) and ``msgpack`` only. The writer
(``connector.recording``, on the writer thread) and the reader
(``logdecode.LogDecoder``) each keep one :class:`WireContext` per *segment*:
a segment runs from a file's header, or from a SNAPSHOT record, to the next
of either. Both reset their context there, so every segment decodes alone
(a file starts one; ``replay explain`` seeks to one).

Compact event forms (inside INPUTS records only; the wire tuple otherwise
as ``codec.to_wire``). A plain wire tuple is always a valid compact form,
so a schema 3 event decodes unchanged (its upcaster is the identity):

* A window (``StepScheduled.window_block_ids``, ``FreeQueueRead``'s) is a
  list of items: an int is a block id; a pair ``(start, length)`` copies
  ``previous[start:start + length]``, where ``previous`` is the segment's
  last non-empty window read (either kind).
* A block hash (``CandidateOffered.block_hashes``, the hashes of
  ``StepScheduled.reallocated``) is ``True`` when it equals the hash last
  sent for that block id in the segment; a sent hash (int or None) becomes
  that block's. In ``HashesRead.block_hashes`` (no block ids on the wire)
  a reference is ``(block_id,)``; its hashes update nothing.

Snapshots: a file's snapshots after its first carry the stored keys (the
one big, slowly moving part of the state) as a delta against the snapshot
before (:func:`compact_snapshot`); so restoring one reads the file's
snapshots before it, not its events.

Batches: a BATCH record ``[BATCH, seq, wall, data]`` holds consecutive
payloads (seq and wall of the first): ``data`` is their msgpack bytes,
concatenated and deflated by one ``zlib`` stream per segment, each batch
ending on a sync flush. So a batch inflates only after the batches before it
in its segment, like the deltas; the reader needs both anyway.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator
from typing import Any, Final

import msgpack

from offload_fsm.commands import ReadHashes
from offload_fsm.errors import LogCorrupt
from offload_fsm.events import Event
from offload_fsm.logformat import BATCH, INPUTS
from offload_fsm.logwire import _WIRE, _packb, outcome_check, outcome_wire
from offload_fsm.machine import Outcome

__all__ = [
    "MAX_BATCH_BYTES",
    "MAX_INDEX_REQUESTS",
    "Deflater",
    "Inflater",
    "WireContext",
    "compact_snapshot",
    "encode_batch",
    "encode_compact_inputs",
    "expand_snapshot",
]

MAX_INDEX_REQUESTS: Final[int] = 65536
"""A segment naming more request ids is indexed as "unknown" (the bound on an INDEX)."""

MAX_BATCH_BYTES: Final[int] = 64 * 1024 * 1024
"""The most bytes a batch may inflate to (a bound on the reader's memory)."""

_MIN_COPY: Final = 3  # a copy pair costs about as much as three block ids
_OFFERED, _STEP, _HASHES, _FREE_QUEUE = 2, 3, 7, 8  # event tags with compact forms
_REQ_FIELD_TAGS: Final = frozenset((1, 2, 4, 5))  # events whose first field is req_id


class WireContext:
    """What the events before in the segment told: the last window read and
    the last hash sent per block id (bounded by the engine's block pool)."""

    __slots__ = ("window", "hashes", "intact")

    def __init__(self) -> None:
        self.window: tuple[int, ...] = ()
        self.hashes: dict[int, Any] = {}
        self.intact = True

    def reset(self) -> None:
        """A segment starts: nothing is known, and nothing is missing."""
        self.window = ()
        self.hashes = {}
        self.intact = True

    def lose(self) -> None:
        """Records of the segment were lost: references cannot be resolved
        until the next segment starts."""
        self.intact = False

    # -- writer side --------------------------------------------------------

    def compact(self, wire: tuple[Any, ...], read_ids: tuple[int, ...] = ()) -> tuple[Any, ...]:
        """The compact form of an event's wire tuple; ``read_ids``: for a
        HashesRead, the block ids its command read (its hashes' order)."""
        tag = wire[0]
        if tag == _STEP:
            window = self._delta(wire[6])
            return (*wire[:6], window, tuple(self._pair(p) for p in wire[7]), wire[8])
        if tag == _OFFERED:
            table = self.hashes
            hashes = []
            for block_id, value in zip(wire[4], wire[5], strict=True):
                if value is not None and table.get(block_id, None) == value:
                    hashes.append(True)
                else:
                    table[block_id] = value
                    hashes.append(value)
            return (*wire[:5], tuple(hashes), *wire[6:])
        if tag == _FREE_QUEUE:
            return (tag, self._delta(wire[1]))
        if tag == _HASHES and len(read_ids) == len(wire[2]):
            table = self.hashes
            return (tag, wire[1], tuple(
                (block_id,) if _worth_a_reference(value) and table.get(block_id) == value
                else value for block_id, value in zip(read_ids, wire[2], strict=True)))
        return wire

    def _pair(self, pair: tuple[int, Any]) -> tuple[int, Any]:
        block_id, value = pair
        if value is not None and self.hashes.get(block_id) == value:
            return (block_id, True)
        self.hashes[block_id] = value
        return pair

    def _delta(self, window: tuple[int, ...]) -> tuple[Any, ...]:
        if not window:
            return window  # an empty read leaves the previous window in place
        previous, self.window = self.window, window
        if not previous:
            return window
        if window == previous:
            return ((0, len(window)),)
        at = {block_id: index for index, block_id in enumerate(previous)}
        out: list[Any] = []
        i, n, m = 0, len(window), len(previous)
        while i < n:
            p = at.get(window[i])
            if p is None:
                out.append(window[i])
                i += 1
                continue
            run = min(n - i, m - p)
            if window[i:i + run] != previous[p:p + run]:
                j = 1
                while j < run and window[i + j] == previous[p + j]:
                    j += 1
                run = j
            if run >= _MIN_COPY:
                out.append((p, run))
            else:
                out.extend(window[i:i + run])
            i += run
        return tuple(out)

    # -- reader side --------------------------------------------------------

    def expand(self, item: tuple[Any, ...]) -> tuple[Any, ...]:
        """The wire tuple of a compact event (the inverse of :meth:`compact`,
        applied in the same order). Raises :class:`LogCorrupt`."""
        tag = item[0]
        try:
            if tag == _STEP:
                window = self._undelta(item[6])
                pairs = tuple(self._unpair(p) for p in item[7])
                return (*item[:6], window, pairs, item[8])
            if tag == _OFFERED:
                table = self.hashes
                hashes = []
                for block_id, value in zip(item[4], item[5], strict=True):
                    if value is True:
                        value = self._known(block_id)
                    else:
                        table[block_id] = value
                    hashes.append(value)
                return (*item[:5], tuple(hashes), *item[6:])
            if tag == _FREE_QUEUE:
                return (tag, self._undelta(item[1]))
            if tag == _HASHES:
                return (tag, item[1], tuple(
                    self._known(v[0]) if type(v) is tuple else v for v in item[2]))
        except (IndexError, TypeError, ValueError) as error:
            raise LogCorrupt(f"compact event tag {tag}: {error!r}") from None
        return item

    def _known(self, block_id: int) -> Any:
        if not self.intact:
            raise LogCorrupt("a hash reference into records lost to damage")
        try:
            return self.hashes[block_id]
        except KeyError:
            raise LogCorrupt(f"a hash reference to block {block_id}, never sent") from None

    def _unpair(self, pair: tuple[int, Any]) -> tuple[int, Any]:
        block_id, value = pair
        if value is True:
            return (block_id, self._known(block_id))
        self.hashes[block_id] = value
        return pair

    def _undelta(self, items: tuple[Any, ...]) -> tuple[int, ...]:
        if not items:
            return ()
        previous = self.window
        out: list[int] = []
        for item in items:
            if type(item) is int:
                out.append(item)
                continue
            if not self.intact:
                raise LogCorrupt("a window delta against records lost to damage")
            start, length = item
            if start < 0 or length < 1 or start + length > len(previous):
                raise LogCorrupt(f"window copy {item!r} outside the previous window "
                                 f"({len(previous)} blocks)")
            out.extend(previous[start:start + length])
        self.window = window = tuple(out)
        return window


def _worth_a_reference(value: Any) -> bool:
    """A ``(block_id,)`` reference (2-4 bytes) beats a hash of 5 bytes and more."""
    return type(value) is int and not -32 <= value < 65536


def requests_of(wire: tuple[Any, ...]) -> Iterator[str]:
    """The request ids an event's wire tuple names (for the segment index)."""
    tag = wire[0]
    if tag in _REQ_FIELD_TAGS:
        yield wire[1]
    elif tag == 6:  # ReceiptsArrived
        for req_id, _ in wire[1]:
            yield req_id
        yield from wire[2]


def encode_compact_inputs(
    seq: int,
    wall_ms: int,
    applied: Iterable[tuple[Event, Outcome]],
    context: WireContext,
    requests: set[str] | None,
    *,
    full_outcomes: bool = False,
) -> bytes:
    """``logformat.encode_inputs`` with compact events (updating ``context``);
    the request ids the events name are added to ``requests``. On an
    exception ``context`` may be part-way: reset it (start a segment)."""
    table = _WIRE
    items: list[Any] = [INPUTS, seq, wall_ms]
    append = items.append
    compact = context.compact
    read_ids: dict[int, tuple[int, ...]] = {}
    for event, outcome in applied:
        wire = table[type(event)](event)
        if wire[0] == _HASHES:
            append(compact(wire, read_ids.pop(wire[1], ())))
        else:
            append(compact(wire))
        if requests is not None and len(requests) < MAX_INDEX_REQUESTS:
            requests.update(requests_of(wire))
        append(outcome_wire(outcome) if full_outcomes else outcome_check(outcome))
        for command in outcome.commands:
            if type(command) is ReadHashes:
                read_ids[command.batch_id] = command.block_ids
    return _packb(items)


_KEYS_FIELD: Final = "stored_keys"  # the one big, slowly moving part of a snapshot


def _keys_at(wire: tuple[Any, ...]) -> int:
    names = dict(wire[1])["State"]
    return int(names.index(_KEYS_FIELD))


def compact_snapshot(wire: tuple[Any, ...], previous: tuple[Any, ...] | None
                     ) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """``snapshot.to_wire`` output with its stored keys as ``{"front": k,
    "tail": keys}`` (drop ``k`` from the front of ``previous``, the keys of
    the file's snapshot before, then append ``keys``) where they are that;
    and the keys, for the next one. ``previous`` None: the snapshot is whole."""
    at = _keys_at(wire)
    body = wire[2]
    keys = body[at]
    if previous is None or not keys or not previous:
        return wire, keys
    try:
        front = previous.index(keys[0])
    except ValueError:
        front = len(previous)
    kept = len(previous) - front
    if keys[:kept] != previous[front:]:
        return wire, keys
    delta = {"front": front, "tail": keys[kept:]}
    return (*wire[:2], (*body[:at], delta, *body[at + 1:]), *wire[3:]), keys


def expand_snapshot(wire: Any, previous: tuple[Any, ...] | None
                    ) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """The inverse of :func:`compact_snapshot`; raises :class:`LogCorrupt`."""
    try:
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
        keys = (*previous[front:], *tail)
        return (*wire[:2], (*body[:at], keys, *body[at + 1:]), *wire[3:]), keys
    except (KeyError, IndexError, TypeError, ValueError) as error:
        raise LogCorrupt(f"snapshot keys: {error!r}") from None


def encode_batch(payloads: list[bytes], deflater: Deflater) -> bytes:
    """A BATCH payload of ``payloads`` (the envelope's seq and wall: the first's)."""
    unpacker = msgpack.Unpacker()
    unpacker.feed(payloads[0][:32])
    unpacker.read_array_header()
    unpacker.skip()  # kind
    seq, wall = unpacker.unpack(), unpacker.unpack()
    return _packb((BATCH, seq, wall, deflater.batch(payloads)))


class Deflater:
    """One segment's zlib stream on the writer side: :meth:`batch` deflates
    payloads into a BATCH record's ``data``."""

    __slots__ = ("_level", "_stream")

    def __init__(self, level: int) -> None:
        self._level = level
        self._stream = zlib.compressobj(level)

    def reset(self) -> None:
        self._stream = zlib.compressobj(self._level)

    def batch(self, payloads: list[bytes]) -> bytes:
        stream = self._stream
        return b"".join([*map(stream.compress, payloads), stream.flush(zlib.Z_SYNC_FLUSH)])


class Inflater:
    """The reader side of :class:`Deflater`: one stream per segment."""

    __slots__ = ("_stream", "_raw")

    def __init__(self) -> None:
        self._stream = zlib.decompressobj()
        self._raw = b""

    def reset(self) -> None:
        self._stream = zlib.decompressobj()

    def _inflate(self, data: bytes) -> msgpack.Unpacker:
        try:
            raw = self._stream.decompress(data, MAX_BATCH_BYTES)
        except zlib.error as error:
            raise LogCorrupt(f"batch does not inflate: {error}") from None
        if self._stream.unconsumed_tail:
            raise LogCorrupt(f"batch inflates past {MAX_BATCH_BYTES} bytes")
        unpacker = msgpack.Unpacker(raw=False, use_list=False, strict_map_key=False,
                                    max_buffer_size=MAX_BATCH_BYTES)
        unpacker.feed(raw)
        self._raw = raw
        return unpacker

    def items(self, data: bytes) -> list[Any]:
        """The decoded msgpack items of one batch's ``data``."""
        unpacker = self._inflate(data)
        try:
            return list(unpacker)
        except Exception as error:  # msgpack raises several unrelated types
            raise LogCorrupt(f"undecodable batch item: {error}") from None

    def payloads(self, data: bytes) -> list[bytes]:
        """The payloads of one batch's ``data``, not decoded."""
        unpacker = self._inflate(data)
        raw, out, at = self._raw, [], 0
        try:
            while at < len(raw):
                unpacker.skip()
                end = unpacker.tell()
                out.append(raw[at:end])
                at = end
        except Exception as error:  # msgpack raises several unrelated types
            raise LogCorrupt(f"undecodable batch item: {error}") from None
        return out
