"""``tail``: follow a running server's event streams over ZeroMQ (one per engine).

The connector's recorder (``lmcache.mp.lazy_offload_log_pub_endpoint``)
binds a PUB socket and publishes every framed record as a two-part message
``[log.records.PUB_TOPIC, frame]``, re-publishing the file header before every
digest so that a late subscriber learns the schema and time base. :func:`follow`
subscribes, validates each frame (CRC) and decodes it, prints one line per
record and reports holes in the event sequence (records dropped by the
publisher's high-water mark, by a slow subscriber, or before it joined).

Untrusted input is bounded: the SUB socket refuses any message part over
one frame (``zmq.MAXMSGSIZE``: libzmq drops the sender's connection before
allocating it), a message of another shape (not ``[topic, frame]``) is
skipped and counted, and every field printed is escaped and cut
(``replay.text``). An argument that is not an endpoint is refused before
anything connects; an endpoint nothing listens at is said once, with how to
check it.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

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
from replay.text import DETAIL_CHARS_MAX, field


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
                f"{field(record.reason, DETAIL_CHARS_MAX)}")
    if isinstance(record, Vanished):
        return f"seq {record.seq} the engine vanished ({field(record.reason, DETAIL_CHARS_MAX)})"
    if isinstance(record, End):
        return f"seq {record.seq} end ({record.events_total} events, digest {record.digest})"
    assert isinstance(record, Header)
    return (f"header schema {record.schema} policy {record.policy} world_size "
            f"{record.world_size} file {record.file_index}")


# The largest message part the SUB socket accepts (``zmq.MAXMSGSIZE``): the
# recorder publishes records of 256 KiB at most (``connector.recorder.stream``).
# libzmq drops a connection that sends a larger one, before allocating it.
MAX_MESSAGE_BYTES = 1 << 20
ENDPOINT_SCHEMES = ("tcp://", "ipc://")


class NotAnEndpoint(ValueError):
    """A ``tail`` argument that is not a ZeroMQ endpoint (a usage error)."""


def check_endpoint(text: str) -> str:
    """``text`` if it is a ``tcp://HOST:PORT`` or ``ipc://PATH`` endpoint;
    else :class:`NotAnEndpoint`, saying what it looks like instead."""
    if text.startswith(ENDPOINT_SCHEMES):
        if text.startswith("tcp://"):
            host, sep, port = text[len("tcp://"):].rpartition(":")
            if not sep or not host or not port.isdigit():
                raise NotAnEndpoint(f"{field(text)}: expected tcp://HOST:PORT")
        return text
    if os.path.exists(text):
        raise NotAnEndpoint(
            f"{field(text)} is a file or directory, not an endpoint: `replay tail` follows a "
            "running server's stream (the endpoint in lmcache.mp.lazy_offload_log_pub_endpoint, "
            "e.g. tcp://127.0.0.1:5600); to read a log, use `replay summary`, `requests` or "
            "`explain` on it")
    raise NotAnEndpoint(f"{field(text)}: expected an endpoint such as tcp://127.0.0.1:5600 "
                        "or ipc:///path/to/socket (lmcache.mp.lazy_offload_log_pub_endpoint)")


@attrs.define(kw_only=True)
class TailResult:
    """What :func:`follow` saw: records printed, holes in the event sequence,
    messages skipped as malformed (not two parts, or a part larger than a
    frame), and whether any stream ever connected."""

    records: int = 0
    gaps: int = 0
    malformed: int = 0
    connected: bool = False


def follow(
    endpoints: str | Sequence[str],
    emit: Callable[[str], None],
    *,
    max_records: int = 0,
    timeout_s: float = 0.0,
) -> TailResult:
    """Print records until ``max_records`` (0 = forever, over all streams),
    END on every stream, or ``timeout_s`` without a message (0 = wait
    forever). Several endpoints (one per engine): one subscription each, and
    each line says which stream (``[n]``, its place in ``endpoints``).
    Nothing listening at an endpoint is said once (with how to check it),
    and tail keeps trying. Raises :class:`NotAnEndpoint` before connecting
    anything if an argument is not an endpoint."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    listed = [endpoints] if isinstance(endpoints, str) else list(endpoints)
    for endpoint in listed:
        check_endpoint(endpoint)
    context = zmq.Context()
    poller = zmq.Poller()
    streams: dict[Any, _Printer] = {}
    monitors: dict[Any, tuple[Any, str, str]] = {}  # monitor -> (socket, endpoint, label)
    result = TailResult()
    try:
        for number, endpoint in enumerate(listed):
            socket = context.socket(zmq.SUB)
            socket.setsockopt(zmq.SUBSCRIBE, PUB_TOPIC)
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            monitor = socket.get_monitor_socket(zmq.EVENT_CONNECTED |
                                                zmq.EVENT_CONNECT_RETRIED |
                                                zmq.EVENT_DISCONNECTED)
            try:
                socket.connect(endpoint)
            except zmq.ZMQError as error:
                raise NotAnEndpoint(f"{field(endpoint)}: {error}") from None
            poller.register(socket, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            label = f"[{number}] " if len(listed) > 1 else ""
            streams[socket] = _Printer(functools.partial(_labelled, emit, label))
            monitors[monitor] = (socket, endpoint, label)
        ended: set[Any] = set()
        told: set[Any] = set()
        deadline = time.monotonic() + timeout_s
        while (max_records <= 0 or result.records < max_records) and len(ended) < len(streams):
            wait_ms = max(0, round((deadline - time.monotonic()) * 1000))
            ready = poller.poll(wait_ms if timeout_s > 0 else None)
            if not ready:
                emit(f"no record for {timeout_s}s; stopping")
                break
            for socket, _ in ready:
                if socket in monitors:
                    watched, endpoint, label = monitors[socket]
                    event = recv_monitor_message(socket)["event"]
                    if event == zmq.EVENT_CONNECTED:
                        result.connected = True
                    elif event == zmq.EVENT_DISCONNECTED:
                        # libzmq does not reconnect after a part over MAXMSGSIZE
                        emit(f"{label}the connection to {endpoint} dropped (the server "
                             "stopped, or sent a message part over "
                             f"{MAX_MESSAGE_BYTES} bytes); reconnecting")
                        watched.disconnect(endpoint)
                        watched.connect(endpoint)
                    elif socket not in told:
                        told.add(socket)
                        emit(f"{label}nothing is listening at {endpoint} (yet); still trying. "
                             f"{_how_to_check(endpoint)}")
                    continue
                parts = _receive(socket)
                deadline = time.monotonic() + timeout_s
                printer = streams[socket]
                if parts is None:
                    result.malformed += 1
                    continue
                before = printer.seen
                if printer.on_message(parts[1]):
                    ended.add(socket)
                result.records += printer.seen - before
    finally:
        for monitor in monitors:
            monitor.close(linger=0)
        for socket in streams:
            socket.disable_monitor()
            socket.close(linger=0)
        context.term()
    result.gaps = sum(printer.gaps for printer in streams.values())
    if result.malformed:
        emit(f"skipped {result.malformed} malformed message(s) (not [topic, frame], or a "
             f"part over {MAX_MESSAGE_BYTES} bytes)")
    return result


def _receive(socket: Any) -> tuple[bytes, bytes] | None:
    """One message's two parts, or None (its parts read and dropped) when it
    has another number of parts, a part too large, or another topic."""
    import zmq

    parts: list[bytes] = []
    count = 0
    while True:
        part = socket.recv(copy=True)
        count += 1
        if count <= 2:
            parts.append(part)
        if not socket.getsockopt(zmq.RCVMORE):
            break
    if count != 2 or parts[0] != PUB_TOPIC or len(parts[1]) > MAX_MESSAGE_BYTES:
        return None
    return parts[0], parts[1]


def _how_to_check(endpoint: str) -> str:
    if endpoint.startswith("tcp://"):
        port = endpoint.rpartition(":")[2]
        return (f"Check that vLLM runs with lmcache.mp.lazy_offload_log_pub_endpoint={endpoint} "
                f"and that the port listens: ss -ltn 'sport = :{port}'")
    return (f"Check that vLLM runs with lmcache.mp.lazy_offload_log_pub_endpoint={endpoint} "
            f"and that the socket exists: ls -l {endpoint[len('ipc://'):]}")


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
            self.emit(f"damaged message ({len(data)} bytes): "
                      f"{field(items, DETAIL_CHARS_MAX)}")
            return None
        payload = items[0].payload
        try:
            record = self.decoder.decode(payload)
        except LogCorrupt as error:
            self.emit(f"undecodable record: {field(error, DETAIL_CHARS_MAX)}")
            return None
        if isinstance(record, Header):
            if payload == self.last_header:
                return None  # a repeated header for late subscribers
            self.last_header = payload
        return record
