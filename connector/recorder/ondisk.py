"""What a run's files already hold: where a recorder that takes a run over goes on.

Contract: reads only; a file that cannot be read, or a record that does not
decode, is skipped (a torn tail, damage). Used by the recorder process when
it starts after another recorder of the same engine died
(``connector.recorder.process``): its GAP starts where the files end.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from offload_fsm.log.decode import LogDecoder
from offload_fsm.log.framing import Damage, scan_stream
from offload_fsm.log.names import file_sort_key, parse_file_name
from offload_fsm.log.records import Digest, Gap, Inputs, LogRecord, Rejected
from offload_fsm.vocabulary.errors import LogCorrupt

__all__ = ["events_on_disk"]


def events_on_disk(directory: Path, prefix: str) -> int | None:
    """How many events the run ``prefix`` has in ``directory`` (the next
    event's ``seq`` after the last its latest readable file holds); None if
    it has no readable file (or ``directory`` is gone: the writer makes it
    again)."""
    try:
        names = list(directory.iterdir())
    except FileNotFoundError:
        return None
    files = sorted((path for path in names
                    if (parsed := parse_file_name(path.name)) is not None
                    and parsed[0] == prefix), key=lambda path: file_sort_key(path.name))
    for path in reversed(files):
        decoder = LogDecoder()
        end: int | None = None
        with contextlib.suppress(OSError), path.open("rb") as stream:
            for item in scan_stream(stream):
                if isinstance(item, Damage):
                    decoder.lose()
                    continue
                try:
                    records = decoder.decode_all(item.payload)
                except LogCorrupt:
                    continue
                for record in records:
                    after = _events_through(record)
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
