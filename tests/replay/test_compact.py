"""Schema 4's compact forms: window deltas and hash references round-trip
through a writer's and a reader's :class:`WireContext`; a plain (schema 3)
wire tuple is a valid compact form; references into lost records raise
rather than decode against a guess; a recorded log is batches of one zlib
stream per segment, and smaller than its plain records."""

from __future__ import annotations

import random
from pathlib import Path

import msgpack
import pytest

from offload_fsm.errors import LogCorrupt
from offload_fsm.framing import Record, scan
from offload_fsm.logcompact import Deflater, Inflater, WireContext
from offload_fsm.logformat import BATCH, INDEX, SNAPSHOT
from replay.reader import payload_kind, read_file
from replay.runner import replay
from tests.replay.conftest import record_workload


def _events(rng: random.Random, count: int) -> list[tuple[object, ...]]:
    """Wire tuples of windows that move like a free queue, offers and hash reads."""
    free = list(range(200))
    hashes = {b: rng.getrandbits(64) for b in free}
    out: list[tuple[object, ...]] = []
    for _ in range(count):
        taken = [free.pop(0) for _ in range(rng.randint(0, 4))]
        for block_id in taken:
            if rng.random() < 0.5:
                hashes[block_id] = rng.getrandbits(64)
        out.append((2, "r", 0, 64, tuple(taken), tuple(hashes[b] if rng.random() < 0.9
                                                      else None for b in taken), 0.5, 1))
        free.extend(rng.sample(taken, len(taken)))
        rng.shuffle(free[150:])
        window = tuple(free[: rng.randint(0, 60)])
        reallocated = tuple((b, hashes[b]) for b in taken)
        out.append((3, 64, len(taken), 2, 1, len(free), window, reallocated, 0.25))
        if rng.random() < 0.3:
            out.append((8, tuple(free[: rng.randint(0, 40)])))
        out.append((7, 5, tuple(hashes[b] for b in taken)))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_compact_forms_round_trip(seed: int) -> None:
    rng = random.Random(seed)
    writer, reader = WireContext(), WireContext()
    events = _events(rng, 300)
    plain = compact = 0
    last_offer: tuple[int, ...] = ()
    for wire in events:
        ids = last_offer if wire[0] == 7 else ()
        if wire[0] == 2:
            last_offer = wire[4]  # type: ignore[assignment]
        packed = writer.compact(wire, ids)
        plain += len(msgpack.packb(wire))
        compact += len(msgpack.packb(packed))
        back = reader.expand(msgpack.unpackb(msgpack.packb(packed), use_list=False))
        assert back == wire
    assert compact < plain * 0.7


def test_a_plain_wire_tuple_is_a_compact_form() -> None:
    events = _events(random.Random(9), 50)
    reader = WireContext()
    for wire in events:
        assert reader.expand(wire) == wire


def test_references_into_lost_records_raise() -> None:
    writer, reader = WireContext(), WireContext()
    first = (3, 64, 0, 2, 1, 100, tuple(range(40)), ((5, 77777777777),), 0.1)
    second = (3, 64, 0, 2, 1, 100, tuple(range(2, 42)), ((5, 77777777777),), 0.2)
    reader.expand(writer.compact(first))
    reader.lose()
    with pytest.raises(LogCorrupt, match="lost to damage"):
        reader.expand(writer.compact(second))
    reader.reset()  # the next segment: plain again on both sides
    writer.reset()
    assert reader.expand(writer.compact(second)) == second
    with pytest.raises(LogCorrupt, match="outside the previous window"):
        WireContext().expand((8, ((0, 5),)))


def test_batches_are_one_stream_per_segment() -> None:
    deflater, inflater = Deflater(6), Inflater()
    payloads = [msgpack.packb([2, i, 0, [1, f"req-{i}"], 0]) for i in range(50)]
    batches = [deflater.batch(payloads[i:i + 10]) for i in range(0, 50, 10)]
    got = [p for batch in batches for p in inflater.payloads(batch)]
    assert got == payloads
    fresh = Inflater()  # a later batch does not inflate without the ones before it
    with pytest.raises(LogCorrupt):
        fresh.items(batches[3])


def test_a_recorded_log_is_batched_and_replays(tmp_path: Path) -> None:
    compact, world = record_workload(tmp_path / "compact", requests=120, seed=5,
                                     pool_blocks=64, concurrency=8,
                                     recorder_options={"snapshot_every": 400})
    plain, _ = record_workload(tmp_path / "plain", requests=120, seed=5, pool_blocks=64,
                               concurrency=8, recorder_options={"compress_level": 0,
                                                                "snapshot_every": 400})
    path = compact / "run-000000.lolog"
    kinds = [payload_kind(r.payload) for r in scan(path.read_bytes()) if isinstance(r, Record)]
    assert BATCH in kinds and kinds.count(SNAPSHOT) >= 2 and INDEX in kinds
    assert path.stat().st_size * 2 < (plain / "run-000000.lolog").stat().st_size
    result = replay(compact)
    assert result.ok and result.ended_cleanly and result.events_applied == len(world.applied)
    assert result.snapshots_checked == kinds.count(SNAPSHOT)
    events = [e for entry in read_file(path) if hasattr(entry, "record")
              and hasattr(entry.record, "events") for e in entry.record.events]
    assert events == [event for event, _ in world.applied]


def test_snapshot_keys_travel_as_a_delta_against_the_snapshot_before() -> None:
    from offload_fsm import snapshot
    from offload_fsm.logcompact import compact_snapshot, expand_snapshot
    from offload_fsm.state import new_state
    from offload_fsm.testing.synthetic import default_config

    state = new_state(default_config(), world_size=2)
    base = 1 << 40  # keys are 64-bit fingerprints
    state.stored_keys = dict.fromkeys(range(base, base + 3000))
    first, keys = compact_snapshot(snapshot.to_wire(state), None)
    assert first == snapshot.to_wire(state)  # the file's first: whole
    for key in range(base, base + 50):
        del state.stored_keys[key]
    state.stored_keys.update(dict.fromkeys(range(base + 9000, base + 9020)))
    second, _ = compact_snapshot(snapshot.to_wire(state), keys)
    assert len(msgpack.packb(second)) < len(msgpack.packb(first)) // 4
    back, _ = expand_snapshot(msgpack.unpackb(msgpack.packb(second), use_list=False), keys)
    assert back == snapshot.to_wire(state)
    with pytest.raises(LogCorrupt, match="earlier snapshot"):
        expand_snapshot(second, None)
    del state.stored_keys[base + 300]  # out of the middle: whole again
    third, _ = compact_snapshot(snapshot.to_wire(state), keys)
    assert third == snapshot.to_wire(state)
