"""A run's segments: where replay can start, and what each span's INDEX says.

A schema 4 file is a sequence of *segments*, each starting with a snapshot
(or, in the run's first file, with the header at event 0) and, when the
writer closed it, ending with an INDEX record: the token steps it spans and
every request id its events name. :func:`segments` lists them with one cheap
pass over the frames (``logfiles.scan.frames``: CRC only; headers,
snapshots' envelopes, INDEX and END records are the only payloads looked
at, nothing is inflated).

Contract: an INDEX is trusted only when it is intact and its ``end_seq`` is
where the next segment (or the END record) starts, so a mid-segment INDEX
(a rotation the writer refused) or one cut off by a crash is never read as
complete; a segment without one is *unindexed* (``index`` None). Framing
damage met on the way is handed back, never raised.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs

from logfiles.runs import run_files
from logfiles.scan import LogDamage, frames
from offload_fsm.log.decode import LogDecoder
from offload_fsm.log.peek import payload_kind, payload_seq, snapshot_head
from offload_fsm.log.records import END, HEADER, INDEX, SNAPSHOT, VANISHED, Header, Index
from offload_fsm.vocabulary.errors import LogCorrupt

__all__ = ["Segment", "segments"]


@attrs.define(kw_only=True)
class Segment:
    """Events from ``seq`` on, in ``path`` from byte ``offset`` (its snapshot,
    or the header of a run starting at event 0)."""

    path: Path
    offset: int
    seq: int
    index: Index | None = None  # trusted INDEX, see the module docstring
    digest: str = ""  # its snapshot's (state before ``seq``)
    first_step: int = -1  # state.step_index before its first event (-1: unknown)
    end_seq: int = -1  # where the next segment or the END starts (-1: unknown)


def segments(path: str | os.PathLike[str], prefix: str | None = None,
             damage: list[LogDamage] | None = None) -> list[Segment]:
    """The run's segments in order (see the module docstring); framing
    damage met on the way is added to ``damage``."""
    out: list[Segment] = []
    candidates: dict[int, Index] = {}  # id(segment) -> its last INDEX seen
    ends: list[int] = []
    for file in run_files(path, prefix):
        decoder = LogDecoder()
        for item in frames(file):
            if isinstance(item, LogDamage):
                if damage is not None:
                    damage.append(item)
                continue
            kind = payload_kind(item.payload)
            if kind == HEADER:
                header = _try(decoder, item.payload)
                if isinstance(header, Header) and header.seq == 0 and item.offset == 0:
                    out.append(Segment(path=file, offset=0, seq=0, first_step=0))
            elif kind == SNAPSHOT:
                head = snapshot_head(item.payload)
                if head is not None:
                    out.append(Segment(path=file, offset=item.offset, seq=head[0],
                                       digest=head[1]))
            elif kind == INDEX and out and out[-1].path == file:
                index = _try(decoder, item.payload)
                if isinstance(index, Index) and index.seq == out[-1].seq:
                    candidates[id(out[-1])] = index
            elif kind == END or kind == VANISHED:
                seq = payload_seq(item.payload)
                if seq is not None:
                    ends.append(seq)
    for number, segment in enumerate(out):
        segment.end_seq = out[number + 1].seq if number + 1 < len(out) else (
            ends[-1] if ends else -1)
        index = candidates.get(id(segment))
        if index is not None and index.end_seq == segment.end_seq:
            segment.index = index
            if segment.first_step < 0:
                segment.first_step = index.first_step
        if number + 1 < len(out) and segment.index is not None:
            out[number + 1].first_step = segment.index.end_step
    return out


def _try(decoder: LogDecoder, payload: bytes) -> Any:
    try:
        return decoder.decode(payload)
    except LogCorrupt:
        return None
