"""``tail``: follow a running server's event stream over ZeroMQ.

The connector's recorder (``lmcache.mp.lazy_offload_log_pub_endpoint``)
binds a PUB socket and publishes every framed record as a two-part message
``[b"lolog", frame]``, re-publishing the file header before every digest so
that a late subscriber learns the schema and time base. :func:`follow`
subscribes, validates each frame (CRC) and decodes it, prints one line per
record and reports holes in the event sequence (records dropped by the
publisher's high-water mark, by a slow subscriber, or before it joined).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from offload_fsm.errors import LogCorrupt
from offload_fsm.framing import Record, scan
from offload_fsm.logformat import Digest, End, Gap, Header, Inputs, LogDecoder, LogRecord

TOPIC = b"lolog"


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
    if isinstance(record, End):
        return f"seq {record.seq} end ({record.events_total} events, digest {record.digest})"
    assert isinstance(record, Header)
    return (f"header schema {record.schema} policy {record.policy} world_size "
            f"{record.world_size} file {record.file_index}")


def follow(
    endpoint: str,
    emit: Callable[[str], None],
    *,
    max_records: int = 0,
    timeout_s: float = 0.0,
) -> int:
    """Print records until ``max_records`` (0 = forever), END, or ``timeout_s``
    without a message (0 = wait forever). Returns the number of gaps seen."""
    import zmq

    context = zmq.Context()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, TOPIC)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(endpoint)
    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    decoder = LogDecoder()
    next_seq: int | None = None
    gaps = 0
    seen = 0
    last_header: bytes = b""
    try:
        while max_records <= 0 or seen < max_records:
            if not poller.poll(int(timeout_s * 1000) if timeout_s > 0 else None):
                emit(f"no record for {timeout_s}s; stopping")
                break
            _topic, data = socket.recv_multipart()
            items = list(scan(data))
            if len(items) != 1 or not isinstance(items[0], Record):
                emit(f"damaged message ({len(data)} bytes): {items}")
                continue
            payload = items[0].payload
            try:
                record = decoder.decode(payload)
            except LogCorrupt as error:
                emit(f"undecodable record: {error}")
                continue
            if isinstance(record, Header):
                if payload == last_header:
                    continue  # a repeated header for late subscribers
                last_header = payload
            seen += 1
            stamp = time.strftime("%H:%M:%S", time.localtime(record.wall_time_s)) \
                if decoder.header is not None else "--:--:--"
            if isinstance(record, Inputs):
                if next_seq is not None and record.seq != next_seq:
                    gaps += 1
                    emit(f"{stamp} GAP: events {next_seq}..{record.seq - 1} not received")
                next_seq = record.seq + len(record.events)
            emit(f"{stamp} {describe(record)}")
            if isinstance(record, End):
                break
    finally:
        socket.close(linger=0)
        context.term()
    return gaps
