"""``tail``: follow a running server's event streams over ZeroMQ (one per engine).

The connector's recorder (``lmcache.mp.lazy_offload_log_pub_endpoint``)
binds a PUB socket and publishes every framed record as a two-part message
``[log.records.PUB_TOPIC, frame]``, re-publishing the file header before every
digest so that a late subscriber learns the schema and time base. :func:`follow`
subscribes, validates each frame (CRC) and decodes it, prints one line per
record and reports holes in the event sequence (records dropped by the
publisher's high-water mark, by a slow subscriber, or before it joined).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

from offload_fsm.log.decode import LogDecoder
from offload_fsm.log.framing import Record, scan
from offload_fsm.log.records import (
    PUB_TOPIC,
    Digest,
    End,
    Gap,
    Header,
    Inputs,
    LogRecord,
    Rejected,
    Vanished,
)
from offload_fsm.vocabulary.errors import LogCorrupt


def describe(record: LogRecord) -> str:
    if isinstance(record, Inputs):
        kinds: dict[str, int] = {}
        for event in record.events:
            name = type(event).__name__
            kinds[name] = kinds.get(name, 0) + 1
        body = " ".join(f"{k}x{v}" for k, v in kinds.items())
        return f"seq {record.seq}..{record.seq + len(record.events) - 1} inputs {body}"
    if isinstance(record, Digest):
        return f"seq {record.seq} digest {record.digest}"
    if isinstance(record, Gap):
        return f"seq {record.seq} GAP: the writer lost {record.lost_count} record(s)"
    if isinstance(record, Rejected):
        return (f"seq {record.seq} REJECTED {type(record.event).__name__}: "
                f"{record.reason}")
    if isinstance(record, Vanished):
        return f"seq {record.seq} the engine vanished ({record.reason})"
    if isinstance(record, End):
        return f"seq {record.seq} end ({record.events_total} events, digest {record.digest})"
    assert isinstance(record, Header)
    return (f"header schema {record.schema} policy {record.policy} world_size "
            f"{record.world_size} file {record.file_index}")


def follow(
    endpoints: str | Sequence[str],
    emit: Callable[[str], None],
    *,
    max_records: int = 0,
    timeout_s: float = 0.0,
) -> int:
    """Print records until ``max_records`` (0 = forever, over all streams),
    END on every stream, or ``timeout_s`` without a message (0 = wait
    forever). Several endpoints (one per engine): one subscription each, and
    each line says which stream (``[n]``, its place in ``endpoints``).
    Returns the number of gaps seen."""
    import zmq

    listed = [endpoints] if isinstance(endpoints, str) else list(endpoints)
    context = zmq.Context()
    poller = zmq.Poller()
    streams: dict[Any, _Printer] = {}
    for number, endpoint in enumerate(listed):
        socket = context.socket(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, PUB_TOPIC)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, 1 << 20)  # records are 256 KiB at most (recording.py)
        socket.connect(endpoint)
        poller.register(socket, zmq.POLLIN)
        label = f"[{number}] " if len(listed) > 1 else ""
        streams[socket] = _Printer(functools.partial(_labelled, emit, label))
    ended: set[Any] = set()
    seen = 0
    try:
        while (max_records <= 0 or seen < max_records) and len(ended) < len(streams):
            ready = poller.poll(int(timeout_s * 1000) if timeout_s > 0 else None)
            if not ready:
                emit(f"no record for {timeout_s}s; stopping")
                break
            for socket, _ in ready:
                _topic, data = socket.recv_multipart()
                printer = streams[socket]
                before = printer.seen
                if printer.on_message(data):
                    ended.add(socket)
                seen += printer.seen - before
    finally:
        for socket in streams:
            socket.close(linger=0)
        context.term()
    return sum(printer.gaps for printer in streams.values())


def _labelled(emit: Callable[[str], None], label: str, line: str) -> None:
    emit(label + line)


class _Printer:
    """One line per record of a subscription; counts holes in the event sequence."""

    def __init__(self, emit: Callable[[str], None]) -> None:
        self.emit = emit
        self.decoder = LogDecoder()
        self.next_seq: int | None = None
        self.gaps = 0
        self.seen = 0
        self.last_header = b""

    def on_message(self, data: bytes) -> bool:
        """Print one message's record; True when it was the END record."""
        record = self._decode(data)
        if record is None:
            return False
        self.seen += 1
        stamp = time.strftime("%H:%M:%S", time.localtime(record.wall_time_s)) \
            if self.decoder.header is not None else "--:--:--"
        if isinstance(record, Inputs | Rejected):
            if self.next_seq is not None and record.seq != self.next_seq:
                self.gaps += 1
                self.emit(f"{stamp} GAP: events {self.next_seq}..{record.seq - 1} not received")
            self.next_seq = record.seq + (len(record.events) if isinstance(record, Inputs) else 1)
        self.emit(f"{stamp} {describe(record)}")
        return isinstance(record, End)

    def _decode(self, data: bytes) -> LogRecord | None:
        """The message's record; None (after saying why, if it was not a
        repeated header) when there is nothing to print."""
        items = list(scan(data))
        if len(items) != 1 or not isinstance(items[0], Record):
            self.emit(f"damaged message ({len(data)} bytes): {items}")
            return None
        payload = items[0].payload
        try:
            record = self.decoder.decode(payload)
        except LogCorrupt as error:
            self.emit(f"undecodable record: {error}")
            return None
        if isinstance(record, Header):
            if payload == self.last_header:
                return None  # a repeated header for late subscribers
            self.last_header = payload
        return record
