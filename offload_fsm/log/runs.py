"""Block-id runs (schema 5): a list of block ids as ids and ``(first, length)``
pairs that copy a stretch of the segment's last list holding ``first``.

Pure module: the writer (``runs``) and the reader (``unruns``) each keep one
:class:`Lists` per segment (``log.compact.WireContext``). A prefix-cache hit
re-offers a prefix other requests offered (the shared system prompt, the
session's earlier turns), so its list is a few pairs. The reader bounds every
expansion before it allocates (``log.bounds``).
"""

from __future__ import annotations

from itertools import repeat
from typing import Any, Final

from offload_fsm.log.bounds import MAX_POOL_BLOCKS, IdAllowance
from offload_fsm.vocabulary.errors import LogCorrupt

__all__ = ["MIN_COPY", "Lists", "runs", "unruns"]

MIN_COPY: Final = 3  # a copy pair costs about as much as three block ids


class Lists:
    """The last of a segment's block lists that held each block id (one
    entry per block id, all pointing at shared tuples, so learning a list
    allocates nothing per block; a block's position is found when a run
    needs it)."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last: dict[int, tuple[int, ...]] = {}

    def learn(self, ids: tuple[int, ...]) -> None:
        """Each block of ``ids`` is now last seen there."""
        self.last.update(zip(ids, repeat(ids)))


def runs(ids: tuple[int, ...], lists: Lists) -> tuple[Any, ...]:
    """``ids`` with each stretch of ``MIN_COPY`` or more that repeats a list
    before as ``(first, length)``: ``length`` ids from ``first`` on in the
    last list that held ``first``; then ``lists`` learns ``ids``."""
    out: list[Any] = []
    last = lists.last
    i, n = 0, len(ids)
    while i < n:
        before = last.get(ids[i])
        if before is not None:
            p = before.index(ids[i])
            m = min(n - i, len(before) - p)
            if ids[i:i + m] != before[p:p + m]:
                j = 1
                while ids[i + j] == before[p + j]:
                    j += 1
                m = j
            if m >= MIN_COPY:
                out.append((ids[i], m))
                i += m
                continue
        out.append(ids[i])
        i += 1
    lists.learn(ids)
    return ids if len(out) == n else tuple(out)


def unruns(items: tuple[Any, ...], lists: Lists, intact: bool, allowance: IdAllowance,
           field: str) -> tuple[int, ...]:
    """The inverse of :func:`runs` for ``field``; raises :class:`LogCorrupt` on a
    run the table cannot resolve, any run when records before were lost, or
    runs past ``allowance`` or past :data:`MAX_POOL_BLOCKS` ids (checked
    before the list is built)."""
    if len(items) > MAX_POOL_BLOCKS:
        raise LogCorrupt(f"{field}: {len(items)} items, more than a list of block ids "
                         f"holds (at most {MAX_POOL_BLOCKS})")
    if tuple not in map(type, items):  # no runs
        _learn(lists, items, field)
        return items
    if not intact:
        raise LogCorrupt("a block-id run against records lost to damage")
    length = 0
    for item in items:
        if type(item) is int:
            length += 1
            continue
        if len(item) != 2 or type(item[0]) is not int or type(item[1]) is not int \
                or item[1] < 1:
            raise LogCorrupt(f"block-id run {item!r}: expected (block id, length >= 1)")
        length += item[1]
    allowance.take(length, field)
    out: list[int] = []
    last = lists.last
    for item in items:
        if type(item) is int:
            out.append(item)
            continue
        block_id, length = item
        before = last.get(block_id)
        if before is None:
            raise LogCorrupt(f"block-id run {item!r}: block {block_id} is in no list before")
        p = before.index(block_id)
        allowance.take_lookup(p, field)
        copied = before[p:p + length]
        if len(copied) != length:
            raise LogCorrupt(f"block-id run {item!r}: past the end of the list it copies "
                             f"({len(before) - p} ids left)")
        out.extend(copied)
    ids = tuple(out)
    _learn(lists, ids, field)
    return ids


def _learn(lists: Lists, ids: tuple[int, ...], field: str) -> None:
    lists.learn(ids)
    if len(lists.last) > MAX_POOL_BLOCKS:
        raise LogCorrupt(f"{field}: the lists before name {len(lists.last)} block ids, more "
                         f"than a block pool holds (at most {MAX_POOL_BLOCKS})")
