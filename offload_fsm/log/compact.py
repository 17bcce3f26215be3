"""The compact event forms (schemas 4 and 5): window deltas, hash references, block-id runs.

Pure module: standard library and ``msgpack`` only. The writer
(``connector.recorder.encoder``, on the writer thread) and the reader
(``log.decode.LogDecoder``) each keep one :class:`WireContext` per *segment*:
a segment runs from a file's header, or from a SNAPSHOT record, to the next
of either. Both reset their context there, so every segment decodes alone
(a file starts one; ``replay explain`` seeks to one).

Compact event forms (inside INPUTS records only; the wire tuple otherwise
as ``log.wire.to_wire``). A plain wire tuple is always a valid compact form,
so a schema 3 event decodes unchanged (its upcaster is the identity):

* A window (``StepScheduled.window_block_ids``, ``FreeQueueRead``'s and,
  from schema 8, ``LookupAnswered``'s) is a list of items: an int is a
  block id; a pair ``(start, length)`` copies
  ``previous[start:start + length]``, where ``previous`` is the segment's
  last non-empty window read (any kind).
* A block hash (``CandidateOffered.block_hashes``, the hashes of
  ``StepScheduled.reallocated``) is ``True`` when it equals the hash last
  sent for that block id in the segment; a sent hash (int or None) becomes
  that block's. In ``HashesRead.block_hashes`` (no block ids on the wire)
  a reference is ``(block_id,)``; its hashes update nothing.
* Schema 5: ``CandidateOffered.block_ids`` is a list of items: an int is a
  block id; a pair ``(first, length)`` copies ``length`` ids from the last
  block list of the segment that held ``first``, from ``first`` on
  (:class:`Lists`; every list updates it once decoded). A prefix-cache hit
  re-offers a prefix other requests offered (the shared system prompt, the
  session's earlier turns), so its list is a few pairs.

Snapshots use the same forms (``log.snapshot_pack``); the records of a
segment are deflated as one stream (``log.batch``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import compress, count, repeat
from operator import is_not
from typing import Any, Final

from offload_fsm.log.bounds import MAX_POOL_BLOCKS, IdAllowance
from offload_fsm.log.records import INPUTS
from offload_fsm.log.runs import MIN_COPY, Lists, runs, unruns
from offload_fsm.log.wire import packb
from offload_fsm.vocabulary.commands import ReadHashes
from offload_fsm.vocabulary.errors import LogCorrupt
from offload_fsm.vocabulary.outcome import Outcome

__all__ = [
    "MAX_INDEX_REQUESTS",
    "WireContext",
    "encode_compact_inputs",
    "hash_reads",
    "refer",
    "requests_of",
    "resolve",
]

MAX_INDEX_REQUESTS: Final[int] = 65536
"""A segment naming more request ids is indexed as "unknown" (the bound on an INDEX)."""

_INT_ONLY: Final = {int}
_OFFERED, _STEP, _HASHES, _FREE_QUEUE, _LOOKUP = 2, 3, 7, 8, 14  # tags with compact forms
_REQ_FIELD_TAGS: Final = frozenset((1, 2, 4, 5, 14))  # events whose first field is req_id


class WireContext:
    """What the events before in the segment told: the last window read, the
    last hash sent per block id and the last offered list holding each block
    id (each bounded by the engine's block pool)."""

    __slots__ = ("window", "hashes", "lists", "intact", "allowance")

    def __init__(self) -> None:
        self.window: tuple[int, ...] = ()
        self.hashes: dict[int, Any] = {}
        self.lists = Lists()
        self.intact = True
        self.allowance = IdAllowance()  # the reader's: renewed per payload (``log.decode``)

    def reset(self) -> None:
        """A segment starts: nothing is known, and nothing is missing."""
        self.window = ()
        self.hashes = {}
        self.lists = Lists()
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
            ids = wire[4]
            return (*wire[:4], runs(ids, self.lists), refer(ids, wire[5], self.hashes),
                    *wire[6:])
        if tag == _FREE_QUEUE:
            return (tag, self._delta(wire[1]))
        if tag == _LOOKUP:
            return (*wire[:4], self._delta(wire[4]))
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
            if run >= MIN_COPY:
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
                window = self._undelta(item[6], "StepScheduled.window_block_ids")
                pairs = tuple(map(self._unpair, item[7]))
                self._bound_hashes()
                return (*item[:6], window, pairs, item[8])
            if tag == _OFFERED:
                ids = unruns(item[4], self.lists, self.intact, self.allowance,
                             "CandidateOffered.block_ids")
                refs = item[5]
                if not self.intact and any(value is True for value in refs):
                    raise LogCorrupt("a hash reference into records lost to damage")
                hashes = resolve(ids, refs, self.hashes, self._known)
                self._bound_hashes()
                return (*item[:4], ids, hashes, *item[6:])
            if tag == _FREE_QUEUE:
                return (tag, self._undelta(item[1], "FreeQueueRead.window_block_ids"))
            if tag == _LOOKUP:
                return (*item[:4], self._undelta(item[4], "LookupAnswered.window_block_ids"),
                        *item[5:])
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

    def _bound_hashes(self) -> None:
        if len(self.hashes) > MAX_POOL_BLOCKS:
            raise LogCorrupt(f"the segment sends hashes of {len(self.hashes)} block ids, more "
                             f"than a block pool holds (at most {MAX_POOL_BLOCKS})")

    def _undelta(self, items: tuple[Any, ...], field: str) -> tuple[int, ...]:
        if not items:
            return ()
        if len(items) > MAX_POOL_BLOCKS:
            raise LogCorrupt(f"{field}: {len(items)} items, more than a window holds "
                             f"(at most {MAX_POOL_BLOCKS})")
        # The common shapes, in C: every id sent, or one copy and then the
        # ids the window's tail gained (the usual step: the window only grows
        # at its tail).
        sent = items[1:]
        if not sent or set(map(type, sent)) == _INT_ONLY:
            if type(items[0]) is int:
                self.window = items
                return items
            if type(items[0]) is tuple and len(items[0]) == 2:
                start, length = items[0]
                self._check_copy(start, length)
                if sent or length != len(self.window):  # else the copy is the window itself
                    self.allowance.take(length + len(sent), field)
                self.window = window = self.window[start:start + length] + sent
                return window
        length = 0
        for item in items:
            length += 1 if type(item) is int else self._check_copy(*item)
        self.allowance.take(length, field)
        previous = self.window
        out: list[int] = []
        for item in items:
            if type(item) is int:
                out.append(item)
                continue
            start, length = item
            out.extend(previous[start:start + length])
        self.window = window = tuple(out)
        return window

    def _check_copy(self, start: int, length: int) -> int:
        """``length`` if ``(start, length)`` copies from the previous window."""
        if not self.intact:
            raise LogCorrupt("a window delta against records lost to damage")
        if type(start) is not int or type(length) is not int or start < 0 or length < 1 \
                or start + length > len(self.window):
            raise LogCorrupt(f"window copy {(start, length)!r} outside the previous window "
                             f"({len(self.window)} blocks)")
        return length


def refer(ids: tuple[int, ...], hashes: tuple[Any, ...], table: dict[int, Any]
           ) -> tuple[Any, ...]:
    """``hashes`` with ``True`` for each that ``table`` holds for its block
    id; the others are sent, and become their block's in ``table``."""
    out = []
    for block_id, value in zip(ids, hashes, strict=True):
        if value is not None and table.get(block_id, None) == value:
            out.append(True)
        else:
            table[block_id] = value
            out.append(value)
    return tuple(out)


def resolve(ids: tuple[int, ...], refs: tuple[Any, ...], table: dict[int, Any],
            known: Callable[[int], Any]) -> tuple[Any, ...]:
    """The inverse of :func:`refer`: ``known(block_id)`` resolves a ``True``
    (and raises :class:`LogCorrupt` for one it cannot)."""
    if True not in refs:  # nothing referred to (a hash equal to 1 only takes the long way)
        table.update(zip(ids, refs, strict=True))
        return refs
    # A prefix-cache hit's shape: the shared blocks referred to, then its own
    # sent; looked up before the sent ones are learnt, as one by one would.
    first = next(compress(count(), map(is_not, refs, repeat(True))), len(refs))
    if len(ids) == len(refs) and True not in refs[first:]:
        with contextlib.suppress(KeyError):
            looked = tuple(map(table.__getitem__, ids[:first]))
            sent = refs[first:]
            table.update(zip(ids[first:], sent, strict=True))
            return looked + sent
    if len(ids) == len(refs) == len(set(ids)):  # each block once: learn, then look up, in C
        table.update(compress(zip(ids, refs, strict=False), map(is_not, refs, repeat(True))))
        with contextlib.suppress(KeyError):
            return tuple(map(table.__getitem__, ids))
    out = []
    for block_id, value in zip(ids, refs, strict=True):
        if value is True:
            value = known(block_id)
        else:
            table[block_id] = value
        out.append(value)
    return tuple(out)


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
    items: Sequence[Any],
    context: WireContext,
    requests: set[str] | None,
    read_ids: Mapping[int, tuple[int, ...]],
) -> bytes:
    """``log.records.encode_wire_inputs`` of ``items`` (``[ev_1, check_1,
    ...]``, events as wire tuples) with compact events (updating
    ``context``); the request ids the events name are added to
    ``requests``. ``read_ids``: the block ids each ``ReadHashes`` command
    read, by its ``batch_id`` (:func:`hash_reads`), so a ``HashesRead``'s
    hashes can refer to their blocks; one not in it stays whole. On an
    exception ``context`` may be part-way: reset it (start a segment)."""
    out: list[Any] = [INPUTS, seq, wall_ms]
    append = out.append
    compact = context.compact
    for index in range(0, len(items), 2):
        wire = items[index]
        if wire[0] == _HASHES:
            append(compact(wire, read_ids.get(wire[1], ())))
        else:
            append(compact(wire))
        if requests is not None and len(requests) < MAX_INDEX_REQUESTS:
            requests.update(requests_of(wire))
        append(items[index + 1])
    return packb(out)


def hash_reads(outcomes: Iterable[Outcome]) -> dict[int, tuple[int, ...]]:
    """The block ids of each ``ReadHashes`` command in ``outcomes``, by its ``batch_id``."""
    out: dict[int, tuple[int, ...]] = {}
    for outcome in outcomes:
        for command in outcome.commands:
            if type(command) is ReadHashes:
                out[command.batch_id] = command.block_ids
    return out
