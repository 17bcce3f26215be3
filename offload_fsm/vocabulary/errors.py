"""Errors the core raises.

One poison path: whatever goes wrong inside ``machine.step`` (an event the
rules forbid, or a bug of the core itself) poisons the machine (it closes
the state: ``State.closed`` says why) and surfaces as a :class:`StepFailed`
carrying the event and the reason; ``machine.drive``
adds the events it had applied in the same callback, so the shell can log
them before the rejection and replay reproduces the rejection itself.
"""

from __future__ import annotations

from typing import Any


class StepFailed(Exception):
    """A step did not apply; the machine is poisoned and every later ``step``
    raises :class:`MachinePoisoned`. ``event``: the rejected event; ``reason``:
    what was wrong; ``applied``: the ``(event, outcome)`` pairs ``drive`` had
    applied before it in the same callback (``()`` from ``step``)."""

    def __init__(self, reason: str, event: Any = None) -> None:
        self.reason = reason
        self.event = event
        self.applied: tuple[tuple[Any, Any], ...] = ()
        super().__init__(reason)


class InvalidEvent(StepFailed):
    """An event that cannot happen in the current state (``legality`` names the
    phase, or a field is out of range)."""

    def __init__(self, event_tag: int, req_id: str | None, reason: str) -> None:
        self.event_tag = event_tag
        self.req_id = req_id
        who = f" for request {req_id!r}" if req_id is not None else ""
        super().__init__(f"invalid event (tag {event_tag}){who}: {reason}")
        self.reason = reason


class CoreFault(StepFailed):
    """The core itself failed while applying an event (an assertion, a missing
    key): a bug, reported with the exception and where it was raised."""


class CommandFailed(Exception):
    """The shell's command executor raised inside ``drive``. The machine is
    poisoned (its command loop cannot finish); ``applied`` as for
    :class:`StepFailed`, ``command`` is the command that failed and
    ``unexecuted`` the commands of its outcome from it on (the state already
    counts them done: an ``EndSession`` among them must still be carried
    out)."""

    def __init__(self, reason: str, command: Any) -> None:
        self.reason = reason
        self.command = command
        self.applied: tuple[tuple[Any, Any], ...] = ()
        self.unexecuted: tuple[Any, ...] = ()
        super().__init__(reason)


class MachinePoisoned(Exception):
    """``step`` was called after a failed step or after shutdown."""


class LogCorrupt(Exception):
    """A log record could not be decoded (see ``log.decode``)."""


class UnknownTag(LogCorrupt):
    def __init__(self, tag: int) -> None:
        self.tag = tag
        super().__init__(f"unknown wire tag {tag}")


class SchemaTooNew(LogCorrupt):
    def __init__(self, version: int, supported: int) -> None:
        self.version = version
        self.supported = supported
        super().__init__(f"log schema version {version} is newer than supported {supported}")
