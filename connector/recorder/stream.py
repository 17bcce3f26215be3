"""The live stream: the log's records, framed, on a ZeroMQ PUB socket.

Contract: runs on the writer thread (``connector.recorder.encoder`` calls
:meth:`LiveStream.publish` with each payload it encodes for subscribers).
It never raises and never blocks: a record that cannot be sent is dropped
and counted (``pub_dropped``; the follower sees the hole), and a stream
whose endpoint cannot be bound is one warning and ``pub_bind_failed``, the
log written without it. Each subscriber's queue holds at most
``budget_bytes``: ZeroMQ bounds it in messages, so a record over
:data:`PUB_MESSAGE_MAX_BYTES` is not published.
"""

from __future__ import annotations

import logging
from typing import Any, Final

from offload_fsm.log.framing import frame
from offload_fsm.log.records import PUB_TOPIC

__all__ = ["PUB_MESSAGE_MAX_BYTES", "SUBSCRIPTION_MAX_BYTES", "LiveStream", "pub_socket"]

PUB_MESSAGE_MAX_BYTES: Final = 256 * 1024
SUBSCRIPTION_MAX_BYTES: Final = 64 * 1024  # the largest message a subscriber may send
_log = logging.getLogger("connector.recorder")


def pub_socket(context: Any, endpoint: str, budget_bytes: int) -> Any:
    """The live stream's PUB socket, bound to ``endpoint``: each subscriber's
    queue holds at most ``budget_bytes`` (in :data:`PUB_MESSAGE_MAX_BYTES`
    records), and what a peer may send it (subscriptions, a few bytes each)
    is cut at :data:`SUBSCRIPTION_MAX_BYTES`: a peer that declares more is
    disconnected before anything is allocated for it."""
    import zmq

    socket = context.socket(zmq.PUB)
    socket.setsockopt(zmq.SNDHWM, max(1, budget_bytes // PUB_MESSAGE_MAX_BYTES))
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, SUBSCRIPTION_MAX_BYTES)
    try:
        socket.bind(endpoint)
    except zmq.ZMQError:
        socket.close(linger=0)
        raise
    return socket


class LiveStream:
    """The PUB socket of ``endpoint``, bound on the first record."""

    def __init__(self, endpoint: str, budget_bytes: int) -> None:
        self.endpoint = endpoint
        self._budget = budget_bytes
        self._socket: Any = None
        self._context: Any = None
        self._noblock = 0
        self.sent = 0
        self.dropped = 0
        self.bind_failed = 0

    def publish(self, payload: bytes) -> None:
        """Send one record to the subscribers (see the module docstring)."""
        if not self.endpoint:
            return
        record = frame(payload)
        if len(record) > PUB_MESSAGE_MAX_BYTES:
            self.dropped += 1
            return
        try:
            if self._socket is None:
                import zmq

                self._context = zmq.Context()
                try:
                    socket = pub_socket(self._context, self.endpoint, self._budget)
                except zmq.ZMQError as error:
                    self.bind_failed = 1
                    _log.warning("event log: the live stream cannot bind %s (%s); the log "
                                 "is written without it", self.endpoint, error)
                    self.endpoint = ""  # stop trying
                    return
                self._socket = socket
                self._noblock = zmq.NOBLOCK
            self._socket.send_multipart((PUB_TOPIC, record), flags=self._noblock)
            self.sent += 1
        except Exception:  # never let the live stream hurt the log
            self.dropped += 1

    def stats(self) -> dict[str, int]:
        return {"pub_sent": self.sent, "pub_dropped": self.dropped,
                "pub_bind_failed": self.bind_failed}

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._context.term()
            self._socket = None
