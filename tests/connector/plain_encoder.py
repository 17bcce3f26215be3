"""An encoder of plain functions for tests of the writer alone
(``connector.recorder.writer_thread.Encoder``; the recorder's is
``connector.recorder.encoder.RecordEncoder``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class PlainEncoder:
    """``encode(item)`` for items, ``encode(make_header())`` for headers,
    ``encode(make_gap(lost))`` for gaps; with ``pack`` the items
    ``batchable`` says go into batches."""

    def __init__(self, encode: Callable[[Any], bytes], make_header: Callable[[], Any],
                 make_gap: Callable[[int], Any], *,
                 pack: Callable[[list[bytes]], bytes] | None = None,
                 batchable: Callable[[Any], bool] | None = None,
                 item_events: Callable[[Any], int] | None = None,
                 item_bytes: Callable[[Any], int] | None = None) -> None:
        self._encode = encode
        self._make_header = make_header
        self._make_gap = make_gap
        self._pack = pack
        self._batchable = batchable
        self._events = item_events
        self._bytes = item_bytes

    def __call__(self, item: Any) -> bytes:
        return self._encode(item)

    def header(self) -> bytes:
        return self._encode(self._make_header())

    def gap(self, lost: int) -> bytes:
        return self._encode(self._make_gap(lost))

    def pack(self, payloads: list[bytes]) -> bytes:
        assert self._pack is not None
        return self._pack(payloads)

    def batchable(self, item: Any) -> bool:
        return self._pack is not None and self._batchable is not None and self._batchable(item)

    def events_of(self, item: Any) -> int:
        return self._events(item) if self._events is not None else 1

    def weight(self, item: Any) -> int:
        return self._bytes(item) if self._bytes is not None else 0
