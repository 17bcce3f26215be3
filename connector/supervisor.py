"""Starting the recorder process and the socket to it.

One recorder per engine, started by :func:`launcher`'s function as
``python -m connector.recorder``: a new interpreter (fork and exec), never a
fork of vLLM's engine process, which may hold CUDA state and threads. It runs
in a session of its own, so a Ctrl-C or a signal to vLLM's process group does
not cut the log short: it ends at the engine's END, or, when the engine dies
without one, when it sees its parent gone (``connector.recorder``).

The socket is a ZeroMQ PAIR over ``ipc://`` in a directory only this user
can enter (0700), one path per recorder started; the recorder binds it and
this side connects, so messages sent before the recorder is up wait for it. ZeroMQ's
high-water marks are off: the hand-off's byte budget bounds what it holds
(``connector.handoff``).
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import zmq

from offload_fsm.log.wire import unpackb

__all__ = ["RecorderLink", "launcher"]

_COPY_BELOW_BYTES = 64 * 1024  # smaller messages are copied (cheaper than tracking a frame)
_COALESCE_BYTES = 64 * 1024  # held messages are handed over at this size, or at flush()


class RecorderLink:
    """One recorder process and its socket (``connector.handoff.Link``)."""

    def __init__(self, context: zmq.Context[Any], path: Path, spec: Mapping[str, Any]) -> None:
        self._socket = context.socket(zmq.PAIR)
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        endpoint = f"ipc://{path}"
        # Connected (the recorder binds): a connecting socket queues what is
        # sent before its peer is there; ZeroMQ connects once it is.
        self._socket.setsockopt(zmq.RECONNECT_IVL, 20)
        self._socket.connect(endpoint)
        env = dict(os.environ)
        # The package may have been found through vLLM's kv_connector_module_path.
        here = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "connector.recorder"], stdin=subprocess.PIPE,
                start_new_session=True, close_fds=True, env=env)
            assert self._process.stdin is not None
            self._process.stdin.write(json.dumps(
                {**spec, "endpoint": endpoint, "parent_pid": os.getpid()}).encode())
            self._process.stdin.close()
        except BaseException:
            self._socket.close(linger=0)
            raise
        self.pid = self._process.pid

    def send(self, message: bytes) -> bool:
        """Hold ``message`` for :meth:`flush`; hand a batch's worth at once."""
        self._pending.append(message)
        self._pending_bytes += len(message)
        return self._pending_bytes < _COALESCE_BYTES or self.flush()

    def flush(self) -> bool:
        """The held messages, back to back, as one ZeroMQ message (one call,
        one wake-up of its I/O thread)."""
        frames, total = self._pending, self._pending_bytes
        self._pending, self._pending_bytes = [], 0
        if not frames:
            return True
        data = frames[0] if len(frames) == 1 else b"".join(frames)
        try:
            # One frame of messages back to back: one ZeroMQ message to hold
            # (its allocations, not one set per step, count against memory).
            self._socket.send(data, zmq.NOBLOCK, copy=total < _COPY_BELOW_BYTES)
        except zmq.ZMQError:
            return False
        return True

    def replies(self) -> list[tuple[Any, ...]]:
        socket = self._socket
        out: list[tuple[Any, ...]] = []
        while socket.get(zmq.EVENTS) & zmq.POLLIN:
            try:
                out.append(unpackb(socket.recv(zmq.NOBLOCK)))
            except zmq.ZMQError:
                break
            except Exception:  # a reply that does not decode is ignored, not fatal
                continue
        return out

    def exit_code(self) -> int | None:
        return self._process.poll()

    def close(self) -> None:
        self._socket.close(linger=0)
        self._process.poll()  # reap it if it is gone


def launcher(spec: Mapping[str, Any]) -> Callable[[], RecorderLink]:
    """A function that starts one more recorder for ``spec`` (the recorder's
    settings, ``connector.recorder``) each time it is called."""
    context: zmq.Context[Any] = zmq.Context(io_threads=1)
    runtime = Path(tempfile.mkdtemp(prefix="lazy-offload-", dir=os.environ.get(
        "XDG_RUNTIME_DIR") if os.path.isdir(os.environ.get("XDG_RUNTIME_DIR", "")) else None))
    runtime.chmod(0o700)
    atexit.register(shutil.rmtree, runtime, True)
    numbers = itertools.count()

    def launch() -> RecorderLink:
        return RecorderLink(context, runtime / f"recorder-{next(numbers)}.sock", spec)

    return launch
