"""Schema 4's BATCH records: one zlib stream per segment.

Pure module: standard library (``zlib``) and ``msgpack`` only.

A BATCH record ``[BATCH, seq, wall, data]`` holds consecutive payloads (seq
and wall of the first): ``data`` is their msgpack bytes, concatenated and
deflated by one ``zlib`` stream per segment (``log.compact``), each batch
ending on a sync flush. So a batch inflates only after the batches before it
in its segment, like the compact forms; the reader needs both anyway.
"""

from __future__ import annotations

import zlib
from typing import Any, Final

import msgpack

from offload_fsm.log.bounds import MAX_BATCH_OBJECTS
from offload_fsm.log.bounds import unpacker as bounded_unpacker
from offload_fsm.log.records import BATCH
from offload_fsm.log.wire import packb
from offload_fsm.vocabulary.errors import LogCorrupt

__all__ = ["MAX_BATCH_BYTES", "Deflater", "Inflater", "encode_batch"]

MAX_BATCH_BYTES: Final[int] = 64 * 1024 * 1024
"""The most bytes a batch may inflate to (a bound on the reader's memory)."""


def encode_batch(payloads: list[bytes], deflater: Deflater) -> bytes:
    """A BATCH payload of ``payloads`` (the envelope's seq and wall: the first's)."""
    unpacker = msgpack.Unpacker()
    unpacker.feed(payloads[0][:32])
    unpacker.read_array_header()
    unpacker.skip()  # kind
    seq, wall = unpacker.unpack(), unpacker.unpack()
    return packb((BATCH, seq, wall, deflater.batch(payloads)))


class Deflater:
    """One segment's zlib stream on the writer side: :meth:`batch` deflates
    payloads into a BATCH record's ``data``."""

    __slots__ = ("_level", "_stream")

    def __init__(self, level: int) -> None:
        self._level = level
        self._stream = zlib.compressobj(level)

    def reset(self) -> None:
        self._stream = zlib.compressobj(self._level)

    def batch(self, payloads: list[bytes]) -> bytes:
        # One compress call per batch, not per payload: each call lets the
        # GIL go and must take it back, which on a busy process is a wait for
        # the switch interval each time.
        stream = self._stream
        return stream.compress(b"".join(payloads)) + stream.flush(zlib.Z_SYNC_FLUSH)


class Inflater:
    """The reader side of :class:`Deflater`: one stream per segment. A batch
    inflates to at most :data:`MAX_BATCH_BYTES` and decodes to at most
    ``log.bounds.MAX_BATCH_OBJECTS`` objects; a stream that ends (the
    writer's never does: each batch ends on a sync flush) is damage, so
    bytes after its end cannot pass unread."""

    __slots__ = ("_stream",)

    def __init__(self) -> None:
        self._stream = zlib.decompressobj()

    def reset(self) -> None:
        self._stream = zlib.decompressobj()

    def _inflate(self, data: bytes) -> bytes:
        stream = self._stream
        try:
            raw = stream.decompress(data, MAX_BATCH_BYTES)
        except zlib.error as error:
            raise LogCorrupt(f"batch does not inflate: {error}") from None
        if stream.unconsumed_tail:
            raise LogCorrupt(f"batch inflates past {MAX_BATCH_BYTES} bytes")
        if stream.eof:
            raise LogCorrupt(f"batch ends its segment's zlib stream, with "
                             f"{len(stream.unused_data)} bytes after the end (a batch "
                             "ends on a sync flush)")
        return raw

    def items(self, data: bytes) -> list[Any]:
        """The decoded msgpack items of one batch's ``data`` (each an array)."""
        unpacker = bounded_unpacker(self._inflate(data), "a batch", MAX_BATCH_OBJECTS)
        out = []
        try:
            for item in unpacker:
                if type(item) is not tuple:
                    raise LogCorrupt(f"a batch item is a {type(item).__name__}, not a record")
                out.append(item)
        except (LogCorrupt, MemoryError):
            raise
        except Exception as error:  # msgpack raises several unrelated types
            raise LogCorrupt(f"undecodable batch item: {error}") from None
        return out

    def payloads(self, data: bytes) -> list[bytes]:
        """The payloads of one batch's ``data``, not decoded."""
        raw = self._inflate(data)
        unpacker = msgpack.Unpacker(max_buffer_size=MAX_BATCH_BYTES)
        unpacker.feed(raw)
        out, at = [], 0
        try:
            while at < len(raw):
                unpacker.skip()
                end = unpacker.tell()
                out.append(raw[at:end])
                at = end
        except Exception as error:  # msgpack raises several unrelated types
            raise LogCorrupt(f"undecodable batch item: {error}") from None
        return out
