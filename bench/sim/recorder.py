"""The recorder process's own CPU, for an arm of ours with the event log on.

Contract: :meth:`RecorderWatch.of` gives a watch on the recorder process of a
lazy manager of ours (``EventSourcedManager.event_log``, a
``connector.handoff.sender.Handoff``), or None when there is none (no connector, a
stock arm, the log off). The loop calls, in order:

* :meth:`~RecorderWatch.wait_up` before serving: waits until the recorder has
  acknowledged what was sent so far (its START), so serving starts with the
  recorder up, as in vLLM, where it starts with the engine long before the
  first request; its interpreter's start-up CPU is left out of the figures.
* :meth:`~RecorderWatch.before_close` right before ``log_final_stats()``
  hands the log's END over: the recorder's CPU while serving.
* :meth:`~RecorderWatch.after_end` right after: polls ``/proc/<pid>/stat``
  until the recorder has exited (it exits after writing END), reads its CPU
  from the exited process's entry (a zombie's ``stat`` keeps its ``utime`` and
  ``stime``), then lets ``Handoff.wait_for_end`` take the END's
  acknowledgement (which reaps it). Polling until the exit, rather than
  sampling at the acknowledgement, counts all of the recorder's work: what it
  still had queued at the close, the END, closing its files.

Every figure is ``utime + stime`` of the recorder process (all its threads,
ZeroMQ's I/O thread included), in seconds. A recorder that was restarted
while serving (its pid changed) is reported as such, its figures not summed.
"""

from __future__ import annotations

import os
import time
from typing import Any

_TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu(pid: int) -> tuple[str, float] | None:
    """``(state letter, utime + stime seconds)`` of ``pid`` from
    ``/proc/<pid>/stat``; None once the process is gone (reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], (int(fields[11]) + int(fields[12])) / _TICK


class RecorderWatch:
    def __init__(self, handoff: Any) -> None:
        self.handoff = handoff
        self.pid: int = handoff._link.pid
        self.started_cpu = 0.0
        self.close_cpu = float("nan")
        self.end_cpu = float("nan")
        self.drain_s = float("nan")  # wall from the close to the recorder's exit
        self.restarted = False
        self.exited = False

    @classmethod
    def of(cls, manager: Any) -> RecorderWatch | None:
        handoff = getattr(manager, "event_log", None)
        if handoff is None or getattr(handoff, "_link", None) is None:
            return None
        return cls(handoff)

    def _sample(self) -> float:
        link = self.handoff._link
        if link is None or link.pid != self.pid:
            self.restarted = True
        got = proc_cpu(self.pid)
        return got[1] if got is not None else float("nan")

    def wait_up(self, timeout_s: float = 120.0) -> None:
        """Until the recorder acknowledged every byte sent so far (its START)."""
        handoff = self.handoff
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            link = handoff._link
            if link is None:
                break
            handoff._take_replies(link)
            if handoff._flight.acked >= handoff._flight.sent:
                break
            time.sleep(0.005)
        self.started_cpu = self._sample()

    def before_close(self) -> None:
        self.close_cpu = self._sample()
        self._closed_at = time.monotonic()

    def after_end(self, timeout_s: float = 600.0) -> None:
        """Poll until the recorder exited; its CPU then; then ``wait_for_end``."""
        deadline = time.monotonic() + timeout_s
        last = float("nan")
        while time.monotonic() < deadline:
            got = proc_cpu(self.pid)
            if got is None:  # reaped by someone else: the last reading stands
                break
            last = got[1]
            if got[0] in "ZX":
                self.exited = True
                break
            time.sleep(0.002)
        self.drain_s = time.monotonic() - self._closed_at
        self.end_cpu = last
        self.handoff.wait_for_end()

    @property
    def serving_cpu_s(self) -> float:
        return self.close_cpu - self.started_cpu

    @property
    def total_cpu_s(self) -> float:
        """From serving's start to the recorder's exit."""
        return self.end_cpu - self.started_cpu
