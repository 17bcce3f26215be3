"""Starting the recorder process and the socket to it.

One recorder per engine, started by :func:`launcher`'s function as
``python -P -m connector.recorder ENGINE_PID`` in ``/`` (:func:`recorder_command`):
a new interpreter (fork and exec), never a fork of vLLM's engine process,
which may hold CUDA state and threads, and one that imports nothing from
the engine's working directory (a planted ``json.py`` there). It runs
in a session of its own, so a Ctrl-C or a signal to vLLM's process group does
not cut the log short, and it leaves the engine's process tree at once
(``connector.recorder.detach``), so vLLM's kill of that tree does not either:
it ends at the engine's END, or, when the engine dies without one, when it
sees the engine gone (``connector.recorder``). Not being the engine's child,
it tells its pid and, at its exit, its exit code on the started process's
standard output, which :class:`RecorderLink` reads without blocking.

The socket is a ZeroMQ PAIR over ``ipc://`` in a directory only this user
can enter (0700), one path per recorder started; the recorder binds it and
this side connects, so messages sent before the recorder is up wait for it. ZeroMQ's
high-water marks are off: the hand-off's byte budget bounds what it holds,
bookkeeping included (``connector.handoff``); the engine's messages go to
ZeroMQ as frames, several back to back, each copied once.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import zmq

from connector.handoff.link import EXIT_UNSAID
from offload_fsm.log.wire import unpackb

__all__ = ["Launcher", "RecorderLink", "launcher", "recorder_command",
           "recorder_environment"]

PID_WAIT_S: Final = 10.0  # the recorder's pid comes from a process that just started


class RecorderLink:
    """One recorder process and its socket (``connector.handoff.Link``)."""

    def __init__(self, context: zmq.Context[Any], path: Path, spec: Mapping[str, Any]) -> None:
        self._socket = context.socket(zmq.PAIR)
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        self._socket.setsockopt(zmq.LINGER, 0)
        # The open frame: messages back to back, no per-message object.
        self._frame = bytearray()
        self.endpoint_path = path
        endpoint = f"ipc://{path}"
        # Connected (the recorder binds): a connecting socket queues what is
        # sent before its peer is there; ZeroMQ connects once it is.
        self._socket.setsockopt(zmq.RECONNECT_IVL, 20)
        self._socket.connect(endpoint)
        try:
            self._process = subprocess.Popen(
                recorder_command(os.getpid()), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                cwd="/", start_new_session=True, close_fds=True, env=recorder_environment())
            assert self._process.stdin is not None and self._process.stdout is not None
            self._process.stdin.write(json.dumps(
                {**spec, "endpoint": endpoint, "parent_pid": os.getpid()}).encode())
            self._process.stdin.close()
        except BaseException:
            self._socket.close(linger=0)
            raise
        # The recorder's pid, then its exit code (connector.recorder.detach).
        self._told = self._process.stdout.fileno()
        os.set_blocking(self._told, False)
        self._lines: list[int] = []
        self._partial = b""
        self._told_all = False  # end of file: the recorder is gone

    @property
    def pid(self) -> int:
        """The recorder's pid (waits for it, at most :data:`PID_WAIT_S`, the
        first time): the started process forks it and exits."""
        deadline = time.monotonic() + PID_WAIT_S
        while not self._lines and not self._told_all and time.monotonic() < deadline:
            select.select([self._told], [], [], 0.05)
            self._read_told()
        if not self._lines:
            raise ProcessLookupError("the recorder never said its pid")
        return self._lines[0]

    def send(self, message: bytes) -> bool:
        """Append ``message`` to the open frame."""
        self._frame += message
        return True

    def flush(self) -> bool:
        """The open frame as one ZeroMQ message (one call, one wake-up of
        its I/O thread); ZeroMQ keeps a copy of exactly its bytes."""
        frame = self._frame
        if not frame:
            return True
        try:
            self._socket.send(frame, zmq.NOBLOCK, copy=True)
        except zmq.ZMQError:
            return False
        finally:
            frame.clear()
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
        """None while the recorder runs; its exit code once it said one;
        :data:`EXIT_UNSAID` when it ended without (a signal); the started
        process's own code when it failed before the recorder forked."""
        started = self._process.poll()
        if started:
            return started
        self._read_told()
        if len(self._lines) > 1:
            return self._lines[1]
        return EXIT_UNSAID if self._told_all else None

    def close(self) -> None:
        self._socket.close(linger=0)
        self._process.poll()  # reap the started process
        assert self._process.stdout is not None
        self._process.stdout.close()

    def _read_told(self) -> None:
        if self._told_all:
            return
        try:
            data = os.read(self._told, 64)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._told_all = True
            return
        *lines, self._partial = (self._partial + data).split(b"\n")
        self._lines.extend(int(line) for line in lines if line.strip().lstrip(b"-").isdigit())


def recorder_command(engine_pid: int) -> list[str]:
    """``python -P -m connector.recorder ENGINE_PID``: with ``-P`` (and
    ``PYTHONSAFEPATH``) nothing from the working directory is importable
    ahead of the standard library; the process also runs in ``/``. The
    engine's pid is for ``ps`` and tools: which engine a recorder is of,
    now that it is not the engine's child (its settings come on stdin)."""
    return [sys.executable, "-P", "-m", "connector.recorder", str(engine_pid)]


def recorder_environment() -> dict[str, str]:
    """The engine's environment, with ``PYTHONSAFEPATH=1``, this package's
    directory first on ``PYTHONPATH`` (vLLM may have found it through
    ``kv_connector_module_path``), and the engine's other ``PYTHONPATH``
    entries made absolute (the recorder runs in ``/``; an empty entry, the
    working directory, is dropped)."""
    env = dict(os.environ)
    here = str(Path(__file__).resolve().parents[2])
    entries = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([here, *entries])
    env["PYTHONSAFEPATH"] = "1"
    return env


class Launcher:
    """Starts one more recorder for ``spec`` (the recorder's settings,
    ``connector.recorder``; its ``directory`` made absolute) each time it is
    called. Its sockets live in a runtime directory of its own (0700, under
    ``$XDG_RUNTIME_DIR`` when there is one); one removed under a running
    engine (a logout, a tmp cleaner) is made again before the next recorder
    starts, or a new one is made elsewhere. :meth:`remove` removes it (at
    vLLM's shutdown, and at the interpreter's exit)."""

    def __init__(self, spec: Mapping[str, Any]) -> None:
        self._context: zmq.Context[Any] = zmq.Context(io_threads=1)
        self._spec = {**spec, "directory": os.path.abspath(spec["directory"])}
        self._runtimes: list[Path] = []
        self._numbers = itertools.count()
        atexit.register(self.remove)

    def __call__(self) -> RecorderLink:
        return RecorderLink(self._context, self._runtime() / f"recorder-{next(self._numbers)}.sock",
                            self._spec)

    def remove(self) -> None:
        """Remove the runtime directories (the recorders' sockets are bound
        there: a running recorder keeps its connection)."""
        for path in self._runtimes:
            shutil.rmtree(path, True)

    def _runtime(self) -> Path:
        if self._runtimes:
            try:
                self._runtimes[-1].mkdir(mode=0o700, exist_ok=True)
                return self._runtimes[-1]
            except OSError:
                pass  # its parent is gone too: a new one
        xdg = os.environ.get("XDG_RUNTIME_DIR", "")
        path = Path(tempfile.mkdtemp(prefix="lazy-offload-", dir=xdg if os.path.isdir(xdg)
                                     else None))
        path.chmod(0o700)
        self._runtimes.append(path)
        return path


def launcher(spec: Mapping[str, Any]) -> Launcher:
    """A :class:`Launcher` for ``spec``."""
    return Launcher(spec)
