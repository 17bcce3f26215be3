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
    """The reader side of :class:`Deflater`: one stream per segment."""

    __slots__ = ("_stream", "_raw")

    def __init__(self) -> None:
        self._stream = zlib.decompressobj()
        self._raw = b""

    def reset(self) -> None:
        self._stream = zlib.decompressobj()

    def _inflate(self, data: bytes) -> msgpack.Unpacker:
        try:
            raw = self._stream.decompress(data, MAX_BATCH_BYTES)
        except zlib.error as error:
            raise LogCorrupt(f"batch does not inflate: {error}") from None
        if self._stream.unconsumed_tail:
            raise LogCorrupt(f"batch inflates past {MAX_BATCH_BYTES} bytes")
        unpacker = msgpack.Unpacker(raw=False, use_list=False, strict_map_key=False,
                                    max_buffer_size=MAX_BATCH_BYTES)
        unpacker.feed(raw)
        self._raw = raw
        return unpacker

    def items(self, data: bytes) -> list[Any]:
        """The decoded msgpack items of one batch's ``data``."""
        unpacker = self._inflate(data)
        try:
            return list(unpacker)
        except Exception as error:  # msgpack raises several unrelated types
            raise LogCorrupt(f"undecodable batch item: {error}") from None

    def payloads(self, data: bytes) -> list[bytes]:
        """The payloads of one batch's ``data``, not decoded."""
        unpacker = self._inflate(data)
        raw, out, at = self._raw, [], 0
        try:
            while at < len(raw):
                unpacker.skip()
                end = unpacker.tell()
                out.append(raw[at:end])
                at = end
        except Exception as error:  # msgpack raises several unrelated types
            raise LogCorrupt(f"undecodable batch item: {error}") from None
        return out
