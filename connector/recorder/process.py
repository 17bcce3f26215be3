"""The recorder process's loop and its handling of each message.

It takes the engine's hand-off (``connector.handoff``) over a ZeroMQ PAIR
socket and does everything else the event log needs, away from vLLM's
process: it folds the events into a state of its own (checking each against
the outcome the engine recorded, ``offload_fsm.refold``), and an
:class:`~connector.recorder.recording.EventRecorder` encodes, compacts, compresses,
frames, rotates, retains, indexes and publishes the live stream, taking
digests and snapshots from that fold.

Its settings arrive as one JSON object on stdin (``connector.handoff.supervisor``).

Theory of operation
-------------------
* START ``(seq, wall_s, lost, snapshot, protocol)``: the fold starts from a
  fresh state (``snapshot`` None, seq 0) or from the engine's snapshot;
  ``lost`` events before ``seq`` never arrived, and the log says so (GAP,
  then the snapshot).
* A START that cannot be honoured (another ``protocol``; a log directory
  that cannot be written: gone read-only, full, not a directory) is
  answered with FAILED ``(cause, text)``, the text naming the fix, and the
  recorder exits (:data:`EXIT_FAILED`): the engine warns once per cause and
  starts a recorder again with backoff. A log directory that is gone is
  made again.
* STEP: each record call's events are folded and recorded with the engine's
  recorded outcomes, so the log says what the engine decided. When the fold
  decides otherwise, or its summary differs from the engine's (a state
  changed outside ``step``), one warning, no digest or snapshot from it, and
  RESYNC asks the engine for a snapshot; the events are still recorded.
* REJECT: the poison path, recorded as the in-process recorder does.
* END: the log ends (with the final digest when the engine's summary matches
  the fold); the recorder acknowledges and exits.
* The engine gone without END (killed, or its process tree killed by vLLM:
  the recorder is not in it, ``connector.recorder.detach``): the recorder
  takes what is still in its socket, records it, ends the log with a
  VANISHED record and exits: it never outlives its engine.
* It acknowledges what it took in, in bytes (ACK), at most every ``_ACK_S``
  or ``_ACK_BYTES``, with its counters about once a second; the engine's
  budget counts the unacknowledged bytes. What it took in waits in its
  writer's queue, bounded by the same budget in the bytes of the objects
  queued (:func:`queued_bytes`), not their wire bytes. While that queue is
  half full it takes nothing more in: what the engine sends waits in the
  socket, unacknowledged, within the engine's budget (past which the
  engine counts an outage), rather than the writer dropping it.
* SIGINT and SIGTERM are ignored: the engine's END, or its death, ends the
  log, so a Ctrl-C to vLLM's process group cannot cut the log short.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import logging
import math
import signal
import sys
import time
from pathlib import Path
from typing import Any, Final

import msgpack
import zmq

from connector.handoff.messages import PROTOCOL, Message, Reply, state_summary
from connector.recorder.detach import EngineWatch
from connector.recorder.encoder import InputsBatch
from connector.recorder.ondisk import events_on_disk
from connector.recorder.recording import EventRecorder
from offload_fsm.log import snapshot
from offload_fsm.log.compact import hash_reads
from offload_fsm.log.decode import build_event
from offload_fsm.log.wire import packb, unpackb
from offload_fsm.refold import refold
from offload_fsm.state import State, new_state
from offload_fsm.vocabulary.config import parse_recorded_config
from offload_fsm.vocabulary.outcome import Outcome

__all__ = ["EXIT_FAILED", "Recorder", "cannot_record", "main"]

_log = logging.getLogger("connector.recorder")
_ACK_S = 0.01
_ACK_BYTES = 256 * 1024
_STATS_S = 1.0
_POLL_MS = 100
_BUSY_S = 0.005  # how long to leave the socket alone while the writer's queue is half full
QUEUED_BYTES_PER_WIRE_BYTE: Final = 16  # see queued_bytes
QUEUED_BYTES_PER_EVENT: Final = 256
EXIT_FAILED: Final = 3  # it sent FAILED: it could not record, or refused the engine


class Recorder:
    """The recorder's state and its handling of each message (see the module
    docstring); ``reply`` sends a message back to the engine."""

    def __init__(self, spec: dict[str, Any], reply: Any) -> None:
        self._spec = spec
        self._reply = reply
        self._config = parse_recorded_config(spec["header_config"]).offload
        self._world_size = int(spec["world_size"])
        self.recorder: EventRecorder | None = None
        self.state: State | None = None  # the fold; None when it cannot be trusted
        self.next_seq = 0
        self.done = False
        self.failed = False  # it refused, or could not open its log: FAILED was sent
        self._warned = False
        self._message_bytes = 0
        self._writer: Any = None  # kept for its counters after the log is closed

    # -- messages ------------------------------------------------------------

    def handle(self, data: bytes) -> None:
        """One frame from the engine: its messages, packed back to back (the
        engine hands several steps over at once)."""
        unpacker = msgpack.Unpacker(raw=False, use_list=False, strict_map_key=False,
                                    max_buffer_size=max(len(data), 1 << 20))
        unpacker.feed(data)
        at = 0
        for message in unpacker:
            end = unpacker.tell()
            self._message_bytes, at = end - at, end
            if not self.done:
                self._one(message)

    def _one(self, message: Any) -> None:
        kind = message[0]
        if kind == Message.STEP:
            self._step(*message[1:])
        elif kind == Message.START:
            self._start(*message[1:])
        elif kind == Message.REJECT:
            self._reject(*message[1:])
        elif kind == Message.END:
            self._end(*message[1:])

    def _start(self, seq: int, wall_s: float, lost: int, packed: bytes | None,
               protocol: int | None = None) -> None:
        """The engine's ``lost`` is what it could not confirm; the GAP says
        what this recorder knows: from the events it took in (or, new after
        a recorder died, the events the run's files hold) up to ``seq``."""
        if protocol != PROTOCOL:
            self._refuse_version(protocol)
            return
        if packed is None:
            state = new_state(self._config, world_size=self._world_size)
        else:
            state = snapshot.restore(unpackb(packed), self._config)
        recorder = self.recorder
        if recorder is None:
            first = 0
            directory = Path(self._spec["directory"])
            try:
                if packed is not None:
                    on_disk = events_on_disk(directory, self._spec["prefix"])
                    first = min(seq, on_disk if on_disk is not None else 0)
                recorder = self.recorder = self._new_recorder(first)
            except OSError as error:
                self._fail(*cannot_record(directory, error))
                return
            self._writer = recorder.writer
            self.next_seq = first
        if packed is not None:
            recorder.resume(seq, seq - min(self.next_seq, seq), state)
        self.state = state
        self.next_seq = seq

    def _refuse_version(self, protocol: int | None) -> None:
        """An engine that speaks another protocol (an upgrade installed under a
        running engine): refuse, once. An engine from before the handshake
        (``protocol`` None) does not read FAILED: this recorder says it on
        stderr, once per engine (a marker beside its socket)."""
        why = (f"this recorder speaks protocol {PROTOCOL}, the engine "
               f"{protocol if protocol is not None else 'one from before version 2'} (the "
               "package was replaced under a running engine?); restart vLLM to record again")
        if protocol is None:
            marker = Path(str(self._spec.get("endpoint", "")).removeprefix("ipc://")).parent \
                / "protocol-refused"
            try:
                marker.touch(mode=0o600, exist_ok=False)
            except FileExistsError:
                pass
            except OSError:
                _log.warning("lazy offload recorder: %s", why)
            else:
                _log.warning("lazy offload recorder: %s", why)
        self._fail("protocol", why)

    def _fail(self, cause: str, why: str) -> None:
        """It cannot record: FAILED to the engine (which warns once per
        ``cause`` and starts a recorder again with backoff), then exit."""
        self.done = self.failed = True
        self._reply(packb((Reply.FAILED, cause, why)))

    def _step(self, seq: int, wall_s: float, summary: Any, callbacks: Any) -> None:
        """One batch as the engine sent it: folded, then recorded as it came."""
        recorder = self.recorder
        if recorder is None:
            return  # no START yet: nothing to record against
        if seq != self.next_seq:
            self._distrust(f"events {self.next_seq}..{seq - 1} never arrived")
            recorder.gap(self.next_seq, seq)
        items = list(itertools.chain.from_iterable(callbacks))
        events = len(items) // 2
        read_ids = self._fold(seq, items)
        self.next_seq = end = seq + events
        if summary is not None and self.state is not None \
                and state_summary(self.state) != tuple(summary):
            self._distrust(f"the state after event {end - 1} differs from the engine's: a "
                           "state changed outside the core's step")
        recorder.record_batch(seq, InputsBatch(items=items, read_ids=read_ids), self.state,
                              size_bytes=queued_bytes(self._message_bytes // max(1, events),
                                                      events))

    def _reject(self, seq: int, wall_s: float, callback: Any, event_wire: Any,
                reason: str) -> None:
        recorder = self.recorder
        if recorder is None:
            return
        if seq != self.next_seq:
            recorder.gap(self.next_seq, seq)
            self.state = None
        items = list(callback)
        events = len(items) // 2
        read_ids = self._fold(seq, items)
        recorder.record_batch(seq, InputsBatch(items=items, read_ids=read_ids), None,
                              size_bytes=queued_bytes(self._message_bytes // max(1, events),
                                                      events))
        recorder.reject(build_event(event_wire), reason)
        self.state = None  # a closed machine: nothing more to fold
        self.next_seq = seq + events + 1

    def _end(self, seq: int, wall_s: float, summary: Any, lost_from: int | None) -> None:
        recorder = self.recorder
        self.done = True
        if recorder is None:
            return
        if lost_from is not None:
            recorder.gap(min(lost_from, self.next_seq), seq)
            self.state = None
        elif seq != self.next_seq:
            recorder.gap(self.next_seq, seq)
            self.state = None
        state = self.state
        trusted = (state is not None and summary is not None
                   and state_summary(state) == tuple(summary))
        recorder.close(state if trusted else None)

    def vanish(self, reason: str) -> None:
        """The engine is gone without END: end the log with what arrived."""
        self.done = True
        if self.recorder is not None:
            self.recorder.close(None, vanished=reason)

    # -- helpers -------------------------------------------------------------

    def _fold(self, seq: int, items: list[Any]) -> dict[int, tuple[int, ...]]:
        """Fold the events of ``items`` (``[ev_1, recorded_1, ...]``, events
        from ``seq`` as wire tuples, each with the engine's recorded
        outcome), each built once without the attrs ``__init__``
        (``log.decode.build_event``); returns the block ids each
        ``ReadHashes`` of the fold read (the compact forms use them). A
        mismatch distrusts the fold."""
        state = self.state
        if state is None:
            return {}
        outcomes: list[Outcome] = []
        pairs = zip(map(build_event, items[::2]), items[1::2], strict=True)
        _, mismatch = refold(state, seq, pairs,
                             lambda _seq, _event, outcome, _state: outcomes.append(outcome))
        if mismatch is not None:
            self._distrust(f"event {mismatch.seq} ({type(mismatch.event).__name__}) decided "
                           "otherwise in the recorder's fold than in the engine")
            del outcomes[mismatch.seq - seq:]
        return hash_reads(outcomes)

    def _distrust(self, why: str) -> None:
        """The fold no longer stands for the engine's state: no digest or
        snapshot from it until the engine's next START."""
        if self.state is None:
            return
        self.state = None
        if not self._warned:
            self._warned = True
            _log.warning("lazy offload recorder: %s; asking the engine for a snapshot", why)
        self._reply(packb((Reply.RESYNC,)))

    def _new_recorder(self, first_seq: int) -> EventRecorder:
        spec = self._spec
        return EventRecorder(
            self._config, self._world_size, spec["directory"], spec["versions"],
            pub_endpoint=spec.get("pub_endpoint", ""),
            digest_every=int(spec.get("digest_every", 1000)),
            full_outcomes=bool(spec.get("full_outcomes", False)),
            prefix=spec["prefix"], engine_index=int(spec.get("engine_index", 0)),
            max_file_bytes=int(spec["max_file_bytes"]),
            max_total_bytes=spec.get("max_total_bytes"),
            snapshot_every=int(spec.get("snapshot_every", 10_000)),
            compress_level=int(spec.get("compress_level", 6)),
            header_config=spec["header_config"], first_seq=first_seq,
            queue_max_bytes=int(spec["budget_bytes"]),
            register_atexit=False,
        )

    @property
    def writer_busy(self) -> bool:
        """Whether its writer's queue holds half its bound or more: what the
        engine sends then waits in the socket, unacknowledged, so the
        engine's budget holds it rather than the writer dropping it."""
        writer = self._writer
        return writer is not None and writer.busy

    def stats(self) -> dict[str, int]:
        recorder = self.recorder
        writer = self._writer
        out = dict(writer.stats()) if writer is not None else {}
        if recorder is not None:
            out.update(recorder.pub_stats())
        return out


def queued_bytes(wire_bytes_per_event: int, events: int) -> int:
    """What ``events`` weigh in the writer's queue, as the Python objects
    they are there (each event and the fold's outcome for it): at most
    :data:`QUEUED_BYTES_PER_WIRE_BYTE` times their wire bytes plus
    :data:`QUEUED_BYTES_PER_EVENT` each (measured: 10 to 15 times the wire
    bytes, 290 to 670 bytes an event, on the synthetic workloads;
    ``tests/connector/test_handoff.py``)."""
    return events * (QUEUED_BYTES_PER_WIRE_BYTE * wire_bytes_per_event + QUEUED_BYTES_PER_EVENT)


_FIXES = {
    errno.EROFS: "the file system is read-only: remount it read-write, or set "
                 "lmcache.mp.lazy_offload_log_dir to a writable directory",
    errno.ENOSPC: "the disk is full: free space, or lower "
                  "lmcache.mp.lazy_offload_log_max_total_mib",
    errno.EDQUOT: "the disk quota is exhausted: free space, or lower "
                  "lmcache.mp.lazy_offload_log_max_total_mib",
    errno.EACCES: "permission denied: give this user write access, or set "
                  "lmcache.mp.lazy_offload_log_dir to a directory it can write",
    errno.EPERM: "permission denied: give this user write access, or set "
                 "lmcache.mp.lazy_offload_log_dir to a directory it can write",
}


def cannot_record(directory: Path, error: OSError) -> tuple[str, str]:
    """Why a recorder cannot open its log in ``directory``: the cause (what
    repeats, for the engine's one warning each) and the text, with the fix."""
    code = error.errno if error.errno is not None else 0
    cause = errno.errorcode.get(code, type(error).__name__)
    fix = _FIXES.get(code, "make it a writable directory, or set "
                     "lmcache.mp.lazy_offload_log_dir to one")
    return cause, (f"the log directory {directory} cannot be written ({error.strerror or error}); "
                   f"{fix}; recording is tried again with backoff")


def _take_waiting(socket: zmq.Socket[Any], recorder: Recorder, limit_bytes: float,
                  *, until_full: bool = True) -> int:
    """Hand the messages waiting in ``socket`` to ``recorder`` until none is left,
    the recorder is done, ``limit_bytes`` were taken or (``until_full``) its
    writer's queue is half full; returns the bytes taken."""
    taken = 0
    while not recorder.done and taken < limit_bytes and not (
            until_full and recorder.writer_busy):
        try:
            frames = socket.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            break
        for data in frames:
            if not recorder.done:
                recorder.handle(data)
            taken += len(data)
    return taken


def _send(socket: zmq.Socket[Any], message: bytes) -> None:
    """To the engine, never blocking: a PAIR socket whose engine is gone has
    no peer, and a blocking send would wait for ever instead of noticing the
    engine vanished; with a peer (no high-water mark) it always queues."""
    with contextlib.suppress(zmq.Again):
        socket.send(message, zmq.NOBLOCK)


def run(spec: dict[str, Any], socket: zmq.Socket[Any]) -> int:
    """The recorder's loop; returns its exit code."""
    engine = EngineWatch(int(spec["parent_pid"]))
    recorder = Recorder(spec, lambda message: _send(socket, message))
    taken = acked = 0
    next_ack = next_stats = time.monotonic()
    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    while not recorder.done:
        if recorder.writer_busy:
            time.sleep(_BUSY_S)  # what waits stays unacknowledged: the engine's budget holds it
        elif poller.poll(_POLL_MS):
            taken += _take_waiting(socket, recorder, _ACK_BYTES - (taken - acked))
        now = time.monotonic()
        if taken != acked and not recorder.failed and (
                now >= next_ack or taken - acked >= _ACK_BYTES or recorder.done):
            stats = recorder.stats() if now >= next_stats or recorder.done else None
            _send(socket, packb((Reply.ACK, taken, stats)))
            acked, next_ack = taken, now + _ACK_S
            if stats is not None:
                next_stats = now + _STATS_S
        if not recorder.done and engine.gone():
            # What the engine sent before it died, whatever the writer's queue
            # holds (past its bound the writer drops and counts, with a GAP).
            _take_waiting(socket, recorder, math.inf, until_full=False)
            if not recorder.done:
                recorder.vanish(f"the engine process {engine.pid} exited without a clean "
                                "shutdown")
    return EXIT_FAILED if recorder.failed else 0


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    spec = json.load(sys.stdin)
    context: zmq.Context[Any] = zmq.Context(io_threads=1)
    socket = context.socket(zmq.PAIR)
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.setsockopt(zmq.LINGER, 2000)  # the last ACK reaches a living engine
    socket.bind(spec["endpoint"])
    try:
        return run(spec, socket)
    finally:
        socket.close()
        context.term()
