"""``replay diff``'s pass 1: one cheap pass over a log for its state digests
and an index of its INPUTS records, never decoding an INPUTS payload.

Contract: :func:`scan_digests` reads each file of a run once through
``logfiles.scan.frames``: DIGEST, SNAPSHOT (its envelope only:
``log.peek.snapshot_head``), HEADER and END records give the digests, the
run's header and where each file starts; every INPUTS record becomes a
:class:`Chunk` (located and keyed by a CRC of its body, not decoded; a
BATCH is inflated, not decoded). Damage is kept as text, one line each, and
what follows damage in its segment is not trusted (compact forms after lost
records do not decode).

:func:`equal_segments` finds the leading segments two runs close with the
same INDEX key (``logfiles.segments``' CRC-only pass): ``scan_digests``
skips them without even inflating them, so a divergence near the end of a
long run costs one pass over the frames and the last segments.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import NamedTuple

import attrs
import msgpack

from logfiles.runs import run_files
from logfiles.scan import LogDamage, frames
from logfiles.segments import Segment
from offload_fsm.log.batch import Inflater
from offload_fsm.log.decode import LogDecoder
from offload_fsm.log.peek import body_at, snapshot_head
from offload_fsm.log.peek import payload_kind as _kind
from offload_fsm.log.records import (
    BATCH,
    DIGEST,
    END,
    HEADER,
    INPUTS,
    SNAPSHOT,
    Digest,
    End,
    Header,
)
from offload_fsm.vocabulary.errors import LogCorrupt

__all__ = ["Chunk", "Digests", "equal_segments", "input_chunk", "scan_digests"]


class Chunk(NamedTuple):
    """An INPUTS record located, not decoded: events ``first_seq`` to
    ``end_seq - 1``, and ``key``, a CRC32 of its body after the envelope's
    wall clock, so equal keys mean equal events and checks. In a schema 4
    file the record is number ``number`` of the frame at ``offset`` (a batch),
    in the segment whose first frame is at ``segment``, and the key is
    chained over the segment's records from its first event: compact forms
    are equal bytes for equal events only after equal records."""

    path: str
    offset: int
    first_seq: int
    end_seq: int
    key: int
    number: int = 0
    segment: int = 0


def input_chunk(path: str, offset: int, payload: bytes, *, index: int = 0, segment: int = 0,
                chain: int | None = None) -> Chunk | None:
    """The :class:`Chunk` of an INPUTS payload (None if its envelope is odd);
    ``chain``: the key it continues (see :class:`Chunk`)."""
    head = body_at(payload)
    if head is None:
        return None
    items, seq, at = head
    key = zlib.crc32(memoryview(payload)[at:], 0 if chain is None else chain)
    # Positional: a diff builds one per INPUTS record of both logs.
    return Chunk(path, offset, seq, seq + (items - 3) // 2, key, index, segment)


@attrs.define(kw_only=True)
class Digests:
    """What pass 1 learnt about one log."""

    digests: dict[int, str] = attrs.Factory(dict)  # after event seq (a snapshot: before seq)
    file_starts: list[tuple[int, Path]] = attrs.Factory(list)  # (first event, file)
    chunks: list[Chunk] = attrs.Factory(list)  # every INPUTS record, in order
    events_seen: int = 0  # the end of the last INPUTS record
    events_total: int = -1  # from END, -1 if none
    damage: list[str] = attrs.Factory(list)
    header: Header | None = None


_Skip = dict[tuple[str, int], int]  # (file, segment offset) -> the segment's end_seq


def scan_digests(path: str | os.PathLike[str], prefix: str | None = None,
                 skip: _Skip | None = None) -> Digests:
    """Pass 1: every state digest of the run, keyed by the last event applied
    before it, and where each file starts; INPUTS payloads are not decoded
    (a batch, schema 4 on, is inflated, not decoded). The segments in ``skip``
    are not even inflated: their events, checks and digests are known equal
    to the other log's (:func:`equal_segments`)."""
    out = Digests()
    for file in run_files(path, prefix):
        _scan_file(out, file, skip or {})
    return out


def equal_segments(a: list[Segment], b: list[Segment]) -> tuple[_Skip, _Skip]:
    """The leading segments two runs share: same events, same snapshot digest
    at their start, and an INDEX key (``log.records.Index.key``) that says the
    same bodies follow, for each side as ``scan_digests``'s ``skip``."""
    skip_a: _Skip = {}
    skip_b: _Skip = {}
    for x, y in zip(a, b):  # noqa: B905 (the shorter run ends the common prefix)
        ix, iy = x.index, y.index
        if (ix is None or iy is None or ix.key is None or ix.key != iy.key
                or (x.seq, x.end_seq, x.digest) != (y.seq, y.end_seq, y.digest)):
            break
        skip_a[(str(x.path), x.offset)] = x.end_seq
        skip_b[(str(y.path), y.offset)] = y.end_seq
    return skip_a, skip_b


def _scan_file(out: Digests, file: Path, skip: _Skip) -> None:
    name = str(file)
    chunks = out.chunks
    decoder = LogDecoder()
    inflater = Inflater()
    segment, chain, broken, skipping = 0, None, False, (name, 0) in skip
    for item in frames(file):
        if isinstance(item, LogDamage):
            out.damage.append(f"{item.path}@{item.offset}: {item.kind}: {item.detail}")
            broken = True
            continue
        kind = _kind(item.payload)
        if skipping and kind in (BATCH, INPUTS):
            continue
        payloads = [item.payload]
        if kind == BATCH and not broken:
            try:
                payloads = inflater.payloads(msgpack.unpackb(item.payload)[3])
            except (LogCorrupt, ValueError, TypeError, IndexError) as error:
                out.damage.append(f"{file}@{item.offset}: {error}")
                broken = True
                continue
        elif kind == BATCH or (broken and chain is not None and kind == INPUTS):
            # Compact forms after damage in their segment do not decode.
            out.damage.append(f"{file}@{item.offset}: a record after damage in its segment")
            continue
        offset = item.offset
        for index, payload in enumerate(payloads):
            if _kind(payload) == INPUTS:  # the hot path: one per step
                chunk = input_chunk(name, offset, payload, index=index, segment=segment,
                                    chain=chain)
                if chunk is not None:
                    chunks.append(chunk)
                    if chain is not None:
                        chain = chunk.key
                continue
            _scan_payload(out, decoder, file, offset, payload)
        if chunks:
            out.events_seen = chunks[-1].end_seq
        if kind in (SNAPSHOT, HEADER):  # a segment starts; its first event seeds the chain
            segment, broken = item.offset, False
            end = skip.get((name, segment))
            skipping = end is not None
            if end is not None:
                out.events_seen = end
            head = snapshot_head(item.payload) if kind == SNAPSHOT else None
            first = (head[0] if head is not None else -1) if kind == SNAPSHOT else (
                decoder.header.seq if decoder.header is not None else 0)
            broken = first < 0  # a snapshot whose seq does not read starts nothing known
            chain = zlib.crc32(b"%d" % first) if decoder.schema >= 4 else None
            inflater.reset()


def _scan_payload(out: Digests, decoder: LogDecoder, file: Path, offset: int,
                  payload: bytes) -> None:
    """A payload other than INPUTS: the digests, headers and the END."""
    kind = _kind(payload)
    if kind == SNAPSHOT:
        head = snapshot_head(payload)
        if head is None:
            out.damage.append(f"{file}@{offset}: a snapshot whose seq does not read")
        elif head[1]:
            out.digests[head[0] - 1] = head[1]
        return
    if kind not in (HEADER, DIGEST, END):
        return
    try:
        record = decoder.decode(payload)
    except LogCorrupt as error:
        out.damage.append(f"{file}@{offset}: {error}")
        return
    if type(record) is Header:
        out.header = out.header or record
        out.file_starts.append((record.seq, file))
    elif type(record) is Digest and record.digest:
        out.digests[record.seq] = record.digest
    elif type(record) is End:
        out.events_total = record.events_total
        if record.digest:
            out.digests[record.seq - 1] = record.digest
