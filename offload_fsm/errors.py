"""Errors the core raises. Anything the outside world can cause is one of these;
``assert`` is kept for the core's own bugs."""

from __future__ import annotations


class InvalidEvent(Exception):
    """An event that cannot happen in the current state. The machine is poisoned
    afterwards: every later ``step`` raises :class:`MachinePoisoned`."""

    def __init__(self, event_tag: int, req_id: str | None, reason: str) -> None:
        self.event_tag = event_tag
        self.req_id = req_id
        self.reason = reason
        who = f" for request {req_id!r}" if req_id is not None else ""
        super().__init__(f"invalid event (tag {event_tag}){who}: {reason}")


class MachinePoisoned(Exception):
    """``step`` was called after an invalid event or after shutdown."""


class LogCorrupt(Exception):
    """A log record could not be decoded (see ``codec``)."""


class UnknownTag(LogCorrupt):
    def __init__(self, tag: int) -> None:
        self.tag = tag
        super().__init__(f"unknown wire tag {tag}")


class SchemaTooNew(LogCorrupt):
    def __init__(self, version: int, supported: int) -> None:
        self.version = version
        self.supported = supported
        super().__init__(f"log schema version {version} is newer than supported {supported}")
