"""The operating system's name for the calling thread, for operators' tools.

Contract: :func:`name_this_thread` sets the name that ``top -H``, ``ps -L`` and
``/proc/PID/task/TID/comm`` show for the calling thread, cut to Linux's 15 bytes.
Elsewhere than Linux, or when the call fails, it does nothing: a name is never
worth a failure.

Why: Python's thread names stay inside Python. To the operating system every
thread of vLLM's engine core carries the process's name, so the CPU that the
connector's own threads take (the step's pass, the event log's I/O) could not be
told apart from vLLM's scheduler; on a CPU engine that CPU is taken from the
model's threads (``bench.soak.cpu`` reports it by thread name).
"""

from __future__ import annotations

import ctypes
import sys
from typing import Final

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
