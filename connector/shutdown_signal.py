"""Tell the manager when vLLM's engine process begins shutting down.

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
unchanged. Nothing is installed off the main thread, or where no Python
handler for SIGTERM is present (not vLLM's engine-core process: an
in-process engine never steps without a caller, so no flush could run).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def install(on_signal: Callable[[], None]) -> bool:
    """Chain ``on_signal`` before the SIGTERM/SIGINT handlers; False (and
    nothing changed) where that cannot help (see the module docstring)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if not callable(signal.getsignal(signal.SIGTERM)):
        return False
    for signum in _SIGNALS:
        previous = signal.getsignal(signum)
        if callable(previous):
            signal.signal(signum, _chained(on_signal, previous))
    return True


def _chained(
    on_signal: Callable[[], None], previous: Callable[[int, FrameType | None], Any]
) -> Callable[[int, FrameType | None], Any]:
    def handler(signum: int, frame: FrameType | None) -> Any:
        on_signal()  # notes a time: cannot keep vLLM's handler from running
        return previous(signum, frame)

    return handler
