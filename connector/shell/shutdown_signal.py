"""Tell the manager when vLLM's engine process begins shutting down, and
make sure that process hears the signal.

vLLM 0.32's engine-core process (``EngineCoreProc.run_engine_core``)
installs SIGTERM/SIGINT handlers before it builds the scheduler (and so this
connector); the handler marks shutdown requested, and the busy loop
(``_handle_shutdown``) keeps stepping while ``has_work()`` is true, which
includes the connector's ``has_pending_push_work``. The process manager
sends SIGTERM (``vllm.v1.utils.shutdown``) and kills the process when its
grace ends (5 s unless the client passed another timeout), and it stops
the workers before the scheduler-side connector's ``shutdown`` runs
(``EngineCore.shutdown``), so that is too late to store anything.

:func:`install` chains one call in front of the handlers that are there:
``on_signal`` only notes the time (it runs between two bytecodes of the
main thread, possibly inside a core step), then the previous handler runs
unchanged. Nothing is installed off the main thread, or unless the SIGTERM
handler there is vLLM's engine core's (:data:`VLLM_ENGINE_CORE`, the module
that defines it): an application that embeds an in-process engine, where a
SIGTERM or SIGINT may mean "cancel", keeps its signals to itself, and its
log and offload are not sealed by one.

A signal the kernel delivers to another thread (any thread that does not
block it may get a process-directed signal) is never heard by an idle
engine: CPython runs Python handlers only on the main thread, when it next
runs bytecode, and vLLM's idle main thread waits on its input queue with no
timeout. The engine then lives until the manager kills it, and the log is
never sealed (it happens with no connector at all; with ours:
``tests/e2e/test_shutdown_signal.py``). So :func:`install` also asks CPython to write
each signal's number to a socket (``signal.set_wakeup_fd``, which its C
handler does on whatever thread the signal lands) and starts one daemon
thread, ``lazy-offload-signal``, that reads it: a SIGTERM/SIGINT after which
the chained handler has not run within :data:`FORWARD_AFTER_S` is sent again
to the main thread (``signal.pthread_kill``), once. The byte that forward
causes is not forwarded again, and nothing is forwarded once vLLM's handler
has run (two signals CPython ran as one handler call leave a byte over) or
the signal's handler is no longer ours (vLLM tearing down restores the
default disposition, which a forward would turn into a kill). Where another
owner already set a wakeup fd, it is left alone and nothing is forwarded. A
child forked after :func:`install` drops the wakeup fd it inherits (its
signals would otherwise reach the parent's forwarder, which would send them
to the parent).
"""

from __future__ import annotations

import functools
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, Final

from connector.shell.logs import get_logger

_SIGNALS: Final = (signal.SIGTERM, signal.SIGINT)
VLLM_ENGINE_CORE: Final = "vllm.v1.engine.core"
"""The module whose SIGTERM handler marks vLLM's engine-core process
(``EngineCoreProc.run_engine_core`` installs it before it builds the
scheduler)."""
FORWARD_AFTER_S: Final[float] = 0.2
"""How long after a signal's byte arrives its handler may take to run
before the signal is sent to the main thread."""
HEARD_WITHIN_S: Final[float] = 2.0
"""How long after a forward the watcher waits for the handler before it
goes back to reading (the main thread may be inside a long C call)."""
_POLL_S: Final[float] = 0.01

_log = get_logger()


def install(on_signal: Callable[[], None]) -> bool:
    """Chain ``on_signal`` before the SIGTERM/SIGINT handlers, and start the
    forwarder; False (and nothing changed) where that cannot help (see the
    module docstring)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if getattr(signal.getsignal(signal.SIGTERM), "__module__", None) != VLLM_ENGINE_CORE:
        return False
    heard = _Heard()
    ours: dict[int, Any] = {}
    for signum in _SIGNALS:
        previous = signal.getsignal(signum)
        if callable(previous):
            ours[signum] = _chained(on_signal, heard, previous)
            signal.signal(signum, ours[signum])
    _start_forwarder(heard, ours)
    return True


class _Heard:
    """How many times the chained handler ran (written on the main thread,
    read by the forwarder; one int under the GIL)."""

    __slots__ = ("runs",)

    def __init__(self) -> None:
        self.runs = 0


def _chained(
    on_signal: Callable[[], None], heard: _Heard,
    previous: Callable[[int, FrameType | None], Any],
) -> Callable[[int, FrameType | None], Any]:
    def handler(signum: int, frame: FrameType | None) -> Any:
        heard.runs += 1
        on_signal()  # notes a time: cannot keep vLLM's handler from running
        return previous(signum, frame)

    return handler


def _start_forwarder(heard: _Heard, ours: dict[int, Any]) -> None:
    reader, writer = socket.socketpair()
    writer.setblocking(False)  # set_wakeup_fd's requirement
    try:
        previous_fd: int | None = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    except ValueError:  # not the main thread of the main interpreter
        previous_fd = None
    if previous_fd != -1:  # not set, or another owner's (theirs stays): no forwarder
        if previous_fd is not None:
            signal.set_wakeup_fd(previous_fd)
        reader.close()
        writer.close()
        return
    os.register_at_fork(after_in_child=functools.partial(_forget_in_child, writer.fileno()))
    main_id = threading.main_thread().ident
    assert main_id is not None
    threading.Thread(target=_forward, args=(reader, writer, heard, main_id, ours),
                     name="lazy-offload-signal", daemon=True).start()


def _forget_in_child(wakeup_fd: int) -> None:
    """A forked child (no forwarder thread in it) must not write its own
    signals into the parent's socket: the parent would forward them."""
    try:
        previous = signal.set_wakeup_fd(-1)
        if previous != wakeup_fd:  # another owner's since: theirs stays
            signal.set_wakeup_fd(previous)
    except ValueError:  # forked from a thread CPython does not take as main
        pass


def _forward(reader: socket.socket, writer: socket.socket, heard: _Heard, main_id: int,
             ours: dict[int, Any]) -> None:
    """The forwarder's loop (module docstring). ``writer`` is held by this
    frame so that its fd, CPython's wakeup fd, stays open; ``ours``: the
    handler installed for each signal."""
    accounted = 0  # the handler runs already matched to a signal
    echoes = 0  # bytes our own forwards will cause
    while True:
        data = reader.recv(64)
        if not data:
            return
        for signum in data:
            if signum not in _SIGNALS:
                continue
            if echoes:
                echoes -= 1
                continue
            if _runs_after(heard, accounted, FORWARD_AFTER_S):
                accounted = heard.runs
                continue
            if heard.runs or signal.getsignal(signum) is not ours.get(signum):
                continue  # vLLM heard one already, or its handler is gone: never again
            _log.warning("lazy offload: the engine's main thread did not hear a signal; "
                         "sent it to the main thread", signal=signal.Signals(signum).name,
                         waited_s=FORWARD_AFTER_S)
            echoes += 1
            signal.pthread_kill(main_id, signum)
            _runs_after(heard, accounted, HEARD_WITHIN_S)
            accounted = heard.runs


def _runs_after(heard: _Heard, accounted: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while heard.runs <= accounted:
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)
    return True
