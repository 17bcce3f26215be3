"""Edit a recorded log as a recorder would have written it.

Tests and benches make "the other run" of a ``replay diff`` by editing a copy
of a log (an outcome check flipped, an input changed). The recorder keys each
segment's INDEX with the bodies it wrote (``log.records.Index.key``), and
``diff`` trusts equal keys without reading the segment, so an edited copy
must carry the keys of what it now holds: :func:`rekeyed` recomputes them.
"""

from __future__ import annotations

import msgpack

from offload_fsm.log.batch import Inflater
from offload_fsm.log.peek import body_key, payload_kind
from offload_fsm.log.records import BATCH, DIGEST, GAP, HEADER, INDEX, INPUTS, REJECTED, SNAPSHOT


def rekeyed(payloads: list[bytes]) -> list[bytes]:
    """A file's frame payloads, in order, with every INDEX key recomputed
    from the INPUTS and DIGEST payloads of its segment (batches inflated)."""
    out: list[bytes] = []
    inflater = Inflater()
    key: int | None = 0
    for payload in payloads:
        kind = payload_kind(payload)
        if kind in (HEADER, SNAPSHOT):
            key = 0
            inflater.reset()
        inner = (inflater.payloads(msgpack.unpackb(payload)[3]) if kind == BATCH else
                 [payload])
        for one in inner:
            if payload_kind(one) in (GAP, REJECTED):
                key = None  # the recorder keys no segment with a loss or a rejection
            elif payload_kind(one) in (INPUTS, DIGEST) and key is not None:
                key = body_key(one, key)
        if kind == INDEX:
            item = list(msgpack.unpackb(payload))
            item[7:] = [key]
            payload = msgpack.packb(item)
        out.append(payload)
    return out
