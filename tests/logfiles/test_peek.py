"""Envelope peeks (``offload_fsm.log.peek``) agree with msgpack on every
integer encoding of a seq and read a snapshot's digest; odd envelopes give
None, never an exception."""

from __future__ import annotations

import msgpack

from offload_fsm.log.peek import payload_seq, snapshot_head
from offload_fsm.log.records import SNAPSHOT

# Each side of every msgpack integer and string encoding's bounds.
SEQS = [0, 127, 128, 255, 256, 65535, 65536, (1 << 32) - 1, 1 << 32, (1 << 64) - 1,
        -1, -32, -33, -128, -129, -32768, -32769, -(1 << 31), -(1 << 31) - 1, -(1 << 63)]
WALLS = [0, 200, 1 << 40, 1.5]
DIGESTS = ["", "0123456789abcdef", "x" * 31, "x" * 32, "é" * 200, "x" * 65536]


def test_the_peeks_read_what_msgpack_reads() -> None:
    for seq in SEQS:
        for wall in WALLS:
            for digest in DIGESTS:
                payload = msgpack.packb([SNAPSHOT, seq, wall, digest, {}])
                assert payload_seq(payload) == seq
                assert snapshot_head(payload) == (seq, digest)


def test_odd_envelopes_give_none_or_no_digest() -> None:
    assert payload_seq(b"") is None
    assert payload_seq(msgpack.packb([SNAPSHOT])) is None  # no seq
    assert payload_seq(msgpack.packb([SNAPSHOT, "7"])) is None  # not an integer
    assert payload_seq(msgpack.packb({"kind": SNAPSHOT})) is None  # not an array
    assert snapshot_head(msgpack.packb([SNAPSHOT, 1 << 40])[:-2]) is None  # cut in the seq
    assert snapshot_head(msgpack.packb([SNAPSHOT, 4, 0, 12])) == (4, "")  # digest not a string
    assert snapshot_head(msgpack.packb([SNAPSHOT, 4, 0, "abcdef"])[:-1]) == (4, "")  # cut
