"""A recording sink paced like a real engine.

A scheduler step takes milliseconds, so the event log's writer thread keeps
up and the recorder sees the writer's "rotate now" signal at the next step.
A synthetic workload records thousands of steps in a tight loop instead:
the writer lags, the signal comes late, and the number of files depends on
thread timing. :func:`paced` waits for the writer to drain after each
callback, so tests of rotation, snapshots and retention are deterministic.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

PACE_TIMEOUT_S = 5.0


def paced(recorder: Any) -> Callable[[Sequence[Any], Any], None]:
    """``recorder.record``, then wait until its writer has written everything."""

    def sink(applied: Sequence[Any], state: Any) -> None:
        recorder.record(applied, state)
        writer = recorder.writer
        if writer is None:
            return
        deadline = time.monotonic() + PACE_TIMEOUT_S
        while time.monotonic() < deadline and (writer.queue_len or writer.writing):
            time.sleep(0.0005)

    return sink
