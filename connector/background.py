"""What the connector tells the operating system about its background work:
its threads' names, and a low priority for work nobody waits on.

Contract.
* :func:`name_this_thread` sets the name that ``top -H``, ``ps -L`` and
  ``/proc/PID/task/TID/comm`` show for the calling thread, cut to Linux's 15
  bytes.
* :func:`yield_to_serving` lowers the calling thread's priority to
  :data:`BACKGROUND_NICE`; threads it starts afterwards inherit it (Linux keeps
  a nice value per thread). Called before a process starts its other threads,
  it lowers the whole process.
* Elsewhere than Linux, or when the system refuses, both do nothing: neither
  is ever worth a failure.

Why names: Python's thread names stay inside Python. To the operating system
every thread of vLLM's engine core carries the process's name, so the CPU that
the connector's own threads take (the step's pass, the event log's I/O) could
not be told from vLLM's scheduler (``bench.soak.cpu`` reports CPU by thread
name).

Why a low priority: on a CPU engine the model's torch threads take every core
and meet at a barrier after each operation; a thread of ours that takes a core
from one of them leaves the others spinning at that barrier, so the model loses
several times the CPU ours used. The event log's I/O thread and the recorder
process are work nobody waits on (their queues are bounded by the log's budget,
past which an outage is counted, never silent), so they run when a core is
idle. The step's pass is not lowered: the next hook waits for it, and a thread
at the lowest priority can wait tens of milliseconds for a core.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from typing import Final

BACKGROUND_NICE: Final = 19  # the lowest priority Linux gives a thread
_PR_SET_NAME: Final = 15  # prctl(2)
_NAME_BYTES: Final = 15  # the kernel's TASK_COMM_LEN, less its NUL


def name_this_thread(name: str) -> None:
    """Name the calling thread ``name`` (module docstring)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode()[:_NAME_BYTES], 0, 0, 0)
    except (OSError, AttributeError):
        return


def yield_to_serving() -> None:
    """Lower the calling thread to :data:`BACKGROUND_NICE` (module docstring)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), BACKGROUND_NICE)
    except OSError:
        return
