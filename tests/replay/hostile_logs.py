"""Crafted hostile logs, each a few KB, each built to make a reader without
the matching bound expand it into hundreds of MB or more (see
``offload_fsm.log.bounds``). Every one starts with the v6 golden log's header,
so it decodes as a schema 6 file up to the hostile record.

Run as a script to write them into a directory (for measuring a reader's
peak memory on each): ``python -m tests.replay.hostile_logs DIR``.
"""

from __future__ import annotations

import sys
import zlib
from collections.abc import Callable
from pathlib import Path

import attrs
import msgpack

from offload_fsm.log.decode import LogDecoder
from offload_fsm.log.framing import Record, frame, scan
from offload_fsm.log.peek import payload_kind
from offload_fsm.log.records import BATCH, INPUTS, SNAPSHOT, Header, encode_header
from offload_fsm.log.wire import packb

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "logs" / "v6" / "golden-000000.lolog"
_FREE_QUEUE_READ, _CANDIDATE_OFFERED = 8, 2  # event tags (``offload_fsm.vocabulary.events``)


def _golden_records() -> list[Record]:
    return [item for item in scan(GOLDEN.read_bytes()) if isinstance(item, Record)]


def _header(seq: int = 0) -> bytes:
    header = LogDecoder().decode(_golden_records()[0].payload)
    assert isinstance(header, Header)
    return encode_header(attrs.evolve(header, seq=seq))


def _batch(raw: bytes, *, finish: bool = False) -> bytes:
    """A BATCH payload whose data inflates to ``raw`` (ending on a sync flush
    as the recorder's do, or finishing the stream)."""
    stream = zlib.compressobj(9)
    data = stream.compress(raw) + stream.flush(zlib.Z_FINISH if finish else zlib.Z_SYNC_FLUSH)
    return packb((BATCH, 0, 0, data))


def _inputs(*events: tuple[object, ...]) -> bytes:
    items: list[object] = [INPUTS, 0, 0]
    for event in events:
        items += [event, 0]
    return packb(items)


def window_copies(rounds: int = 4, copies: int = 200) -> bytes:
    """FreeQueueRead windows, each ``copies`` copies of the whole window
    before: the window grows ``copies`` times per event (100, 20,000, 4
    million, 800 million ids...)."""
    events: list[tuple[object, ...]] = [(_FREE_QUEUE_READ, tuple(range(100)))]
    length = 100
    for _ in range(rounds - 1):
        events.append((_FREE_QUEUE_READ, ((0, length),) * copies))
        length *= copies
    return frame(_header()) + frame(_inputs(*events))


def window_repeats(events: int = 1000) -> bytes:
    """A window of 4 million ids (as :func:`window_copies` makes it), then
    ``events`` windows that each copy it whole and add one id: each within
    the bound on one window, but 32 MB apiece, in one batch."""
    grown = (_FREE_QUEUE_READ, ((0, 20_000),) * 200)
    repeats = [(_FREE_QUEUE_READ, ((0, 4_000_000), n % 100)) for n in range(events)]
    records = _inputs((_FREE_QUEUE_READ, tuple(range(100))),
                      (_FREE_QUEUE_READ, ((0, 100),) * 200), grown, *repeats)
    return frame(_header()) + frame(_batch(records))


def batch_stream_end() -> bytes:
    """A batch whose zlib stream ends, with more bytes after the end: what
    follows it in the segment would inflate to nothing, silently."""
    first = _batch(_inputs((_FREE_QUEUE_READ, (1, 2, 3))), finish=True)
    data = _unpack(first)[3]
    assert isinstance(data, bytes)
    return frame(_header()) + frame(packb((BATCH, 0, 0, data + b"unread")))


def list_runs(length: int = 100_000, copies: int = 20_000) -> bytes:
    """A CandidateOffered of ``length`` ids, then one whose block ids are
    ``copies`` runs of that whole list (``length * copies`` ids: 2 billion),
    in one batch: the repeats deflate to almost nothing."""
    first = (_CANDIDATE_OFFERED, "a", 0, 16 * length, (5,) * length, (None,) * length, 0.0, 0)
    second = (_CANDIDATE_OFFERED, "b", 0, 16 * length, ((5, length),) * copies, (None,), 0.0,
              0)
    return frame(_header()) + frame(_batch(_inputs(first) + _inputs(second)))


def run_lookups(length: int = 800_000, runs: int = 3_000) -> bytes:
    """A CandidateOffered of ``length`` ids whose last is block 7, then one of
    ``runs`` one-id runs from block 7, in one batch: each run searches the
    whole list for it (a few ms apiece, 15 s in all, from a few KB)."""
    first = (_CANDIDATE_OFFERED, "a", 0, 16 * length, (0,) * (length - 1) + (7,),
             (None,) * length, 0.0, 0)
    second = (_CANDIDATE_OFFERED, "b", 0, 16 * runs, ((7, 1),) * runs, (None,) * runs, 0.0, 0)
    return frame(_header()) + frame(_batch(_inputs(first, second)))


def msgpack_objects(arrays: int = 16, maps: int = 1 << 20) -> bytes:
    """A batch that inflates within its byte bound (16 MiB) to ``arrays``
    arrays of ``maps`` empty msgpack maps: one map per byte, about 80 bytes
    of Python objects per inflated byte."""
    array = b"\xdd" + maps.to_bytes(4, "big") + b"\x80" * maps
    return frame(_header()) + frame(_batch(array * arrays))


def _later_file(snapshot_state: bytes) -> bytes:
    """A file that starts later in the golden run: a header at its first
    snapshot's seq, then that snapshot with ``snapshot_state`` as its
    deflated state, which replay must restore before anything else."""
    records = _golden_records()
    at = next(i for i, record in enumerate(records) if payload_kind(record.payload) == SNAPSHOT)
    kind, seq, wall, digest, _ = _unpack(records[at].payload)
    return frame(_header(seq)) + frame(packb((kind, seq, wall, digest, snapshot_state)))


def _unpack(payload: bytes) -> tuple[object, ...]:
    item = msgpack.unpackb(payload, use_list=False)
    assert isinstance(item, tuple)
    return item


def _golden_snapshot_state() -> bytes:
    """The deflated state of the golden log's first snapshot."""
    records = _golden_records()
    payload = next(r.payload for r in records if payload_kind(r.payload) == SNAPSHOT)
    state = _unpack(payload)[4]
    assert isinstance(state, bytes)
    return state


def snapshot_unused_data(junk: bytes = b"\x78\x9c hostile bytes after the stream") -> bytes:
    """A valid snapshot whose deflated state has bytes after its zlib stream."""
    return _later_file(_golden_snapshot_state() + junk)


def snapshot_bomb(inflated_bytes: int = 4 << 20) -> bytes:
    """A snapshot whose state inflates to an array of ``inflated_bytes`` empty
    maps (a few KB deflated): past its bound (64x its size, at least 1 MiB)."""
    raw = b"\xdd" + inflated_bytes.to_bytes(4, "big") + b"\x80" * inflated_bytes
    return _later_file(zlib.compress(raw, 9))


def snapshot_empty_records(records: int = 1_000_000) -> bytes:
    """The golden snapshot with ``records`` empty Batch records (one byte
    each, within its inflate bound): each would become a Batch object of
    some 200 bytes before its width is checked."""
    wire = msgpack.unpackb(zlib.decompress(_golden_snapshot_state()), use_list=False,
                           strict_map_key=False)
    at = 2 + [name for name, _ in wire[1]].index("Batch")
    hollow = (*wire[:at], ((),) * records, *wire[at + 1:])
    return _later_file(zlib.compress(packb(hollow), 9))


KINDS: dict[str, Callable[[], bytes]] = {
    "window-copies": window_copies,
    "window-repeats": window_repeats,
    "batch-stream-end": batch_stream_end,
    "list-runs": list_runs,
    "run-lookups": run_lookups,
    "msgpack-objects": msgpack_objects,
    "snapshot-unused-data": snapshot_unused_data,
    "snapshot-bomb": snapshot_bomb,
    "snapshot-empty-records": snapshot_empty_records,
}


def main(directory: str) -> None:
    target = Path(directory)
    target.mkdir(parents=True, exist_ok=True)
    for name, build in KINDS.items():
        data = build()
        (target / f"{name}.lolog").write_bytes(data)
        print(f"{name}: {len(data)} bytes")


if __name__ == "__main__":
    main(sys.argv[1])
