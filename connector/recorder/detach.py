"""Leaving the engine's process tree, and watching the engine from outside it.

vLLM stops an engine core it gives up on with ``kill_process_tree``: it lists
the core's descendants (psutil's ``children(recursive=True)``) and SIGKILLs
each, and under ``vllm serve``'s default ``--shutdown-timeout 0`` it does so in
the millisecond after the core got SIGTERM. A recorder that is the core's
child dies with it, before it can write the END the core has just handed
over, or VANISHED. So the process the engine starts forks at once and exits
(:func:`detach`): the recorder is its child, re-parented to init or the
nearest subreaper, outside every tree vLLM walks, and still in the session of
its own the engine gave it. It ends with its engine all the same: it watches
the engine's pid (:class:`EngineWatch`) and ends the log with VANISHED when
the engine is gone without END.

What a child would tell its parent goes through the started process's
standard output, a pipe the engine reads (``connector.handoff.supervisor``):
the first line is the recorder's pid, written by the exiting parent; the
second, written by the recorder as it exits, its exit code. End of file
without the second line: the recorder was killed.

Linux only (``os.fork``, ``os.pidfd_open``); without a pidfd (a kernel older
than 5.3) the engine is watched with signal 0, which sees an engine that
nobody has reaped yet as alive.
"""

from __future__ import annotations

import contextlib
import os
import select

__all__ = ["EngineWatch", "detach", "report_exit"]


def detach() -> int:
    """Fork; the parent writes the child's pid on standard output and exits.
    Returns, in the child, a descriptor for :func:`report_exit` (its standard
    output now goes to ``/dev/null``, so nothing else reaches the pipe)."""
    pid = os.fork()
    if pid:
        os.write(1, f"{pid}\n".encode())
        os._exit(0)
    report = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    return report


def report_exit(report: int, code: int) -> None:
    """The exit code's line; an engine that stopped reading is no error."""
    with contextlib.suppress(OSError):
        os.write(report, f"{code}\n".encode())
    with contextlib.suppress(OSError):
        os.close(report)


class EngineWatch:
    """Whether the engine process ``pid`` has exited (module docstring)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._fd: int | None = None
        self._gone = False
        try:
            self._fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._gone = True
        except OSError:
            self._fd = None  # no pidfd here: signal 0

    def gone(self) -> bool:
        if self._gone:
            return True
        if self._fd is not None:
            self._gone = bool(select.select([self._fd], [], [], 0)[0])
        else:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self._gone = True
            except PermissionError:
                pass  # alive, and someone else's: a reused pid cannot be ours
        return self._gone
