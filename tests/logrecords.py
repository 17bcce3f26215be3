"""Test helpers: any log record as a payload and back, one at a time.

The recorder writes records through the ``encode_*`` functions of
``offload_fsm.log.records`` and reads them with ``LogDecoder``; these build
single payloads from record objects for tests that forge or check one.
"""

from __future__ import annotations

from typing import Any

from offload_fsm.log import records
from offload_fsm.log.decode import LogDecoder
from offload_fsm.log.records import LogRecord
from offload_fsm.log.wire import packb, to_wire


def encode_record(record: LogRecord, *, created_s: float) -> bytes:
    """Any record as a payload; times relative to ``created_s`` (the header's)."""
    if isinstance(record, records.Header):
        return records.encode_header(record)
    ms = max(0, round((record.wall_time_s - created_s) * 1000.0))
    if isinstance(record, records.Inputs):
        items: list[Any] = [records.INPUTS, record.seq, ms]
        for event, check in zip(record.events, record.checks, strict=True):
            items.append(to_wire(event))
            items.append(check)
        return packb(items)
    if isinstance(record, records.Digest):
        return records.encode_digest(record.seq, ms, record.digest)
    if isinstance(record, records.Gap):
        return records.encode_gap(record.seq, ms, record.lost_count)
    if isinstance(record, records.Rejected):
        return records.encode_rejected(record.seq, ms, record.event, record.reason)
    if isinstance(record, records.Snapshot):
        return records.encode_snapshot(record.seq, ms, record.digest, record.wire())
    if isinstance(record, records.Index):
        return records.encode_index(record.seq, ms, record.first_step, record.end_seq,
                            record.end_step, record.requests, record.key)
    return records.encode_end(record.seq, ms, record.events_total, record.digest)


def decode_record(payload: bytes, *, schema: int = records.SCHEMA_VERSION,
                  created_s: float = 0.0) -> LogRecord:
    """One payload (not a BATCH) of a file written under ``schema`` whose
    header says ``created_s``; a header decodes under its own version."""
    decoder = LogDecoder()
    decoder.schema = schema
    decoder.created_s = created_s
    return decoder.decode(payload)
