"""What a run's files already hold: where a recorder that takes a run over goes on.

Contract: reads only, through ``logfiles`` (the one lister and scanner of
log files); a file that cannot be read, and damage in one, are skipped (a
torn tail). Used by the recorder process when it starts after another
recorder of the same engine died (``connector.recorder.process``): its GAP
starts where the files end.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from logfiles.runs import files_of
from logfiles.scan import Entry, read_file
from offload_fsm.log.records import Digest, Gap, Inputs, LogRecord, Rejected

__all__ = ["events_on_disk"]


def events_on_disk(directory: Path, prefix: str) -> int | None:
    """How many events the run ``prefix`` has in ``directory`` (the next
    event's ``seq`` after the last its latest readable file holds); None if
    it has no readable file (or ``directory`` is gone: the writer makes it
    again)."""
    try:
        files = files_of(directory, prefix)
    except FileNotFoundError:
        return None
    for path in reversed(files):
        end: int | None = None
        with contextlib.suppress(OSError):
            for entry in read_file(path):
                if isinstance(entry, Entry):
                    after = _events_through(entry.record)
                    end = after if end is None else max(end, after)
        if end is not None:
            return end
    return None


def _events_through(record: LogRecord) -> int:
    """The number of events a run has once ``record`` is in its log."""
    if isinstance(record, Inputs):
        return record.seq + len(record.events)
    if isinstance(record, Gap):
        return record.seq + record.lost_count
    if isinstance(record, Rejected):
        return record.seq + 1
    if isinstance(record, Digest):
        return record.seq + 1
    return record.seq
