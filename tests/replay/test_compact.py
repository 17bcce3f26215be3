"""Schema 4's compact forms: window deltas and hash references round-trip
through a writer's and a reader's :class:`WireContext`; a plain (schema 3)
wire tuple is a valid compact form; references into lost records raise
rather than decode against a guess; a recorded log is batches of one zlib
stream per segment, and smaller than its plain records. Schema 5's block-id
runs and compact snapshot ops round-trip too, on a real scheduler's log, and
schema 8's lookup windows travel as deltas like the other windows."""

from __future__ import annotations

import random
from pathlib import Path

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from logfiles.scan import read_file
from logfiles.segments import segments
from offload_fsm.log.batch import Deflater, Inflater
from offload_fsm.log.compact import WireContext, refer, resolve
from offload_fsm.log.framing import Record, scan
from offload_fsm.log.peek import payload_kind
from offload_fsm.log.records import BATCH, INDEX, SNAPSHOT
from offload_fsm.vocabulary.errors import LogCorrupt
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
        if rng.random() < 0.3:  # a lookup's walk of the head (schema 8)
            reach = rng.randint(1, 80)
            out.append((14, "w", reach, len(free), tuple(free[:reach])))
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


@pytest.mark.parametrize(("before", "after", "shape"), [
    (tuple(range(10)), tuple(range(20, 30)), "sent"),  # every id sent
    (tuple(range(10)), (*range(4, 10), 40, 41), "copy, then sent"),
    (tuple(range(10)), tuple(range(2, 9)), "copy"),
    (tuple(range(10)), (50, *range(3, 10)), "sent, then copy"),
    (tuple(range(10)), (*range(0, 4), 60, *range(5, 10), 61), "interleaved"),
])
def test_a_window_delta_of_any_shape_is_undone(
    before: tuple[int, ...], after: tuple[int, ...], shape: str
) -> None:
    """The shapes ``_undelta`` undoes in C (every id sent; one copy, then sent
    ids) and those it loops over give the same windows."""
    writer, reader = WireContext(), WireContext()
    for window in (before, after):
        wire = (3, 64, 0, 2, 1, 100, window, (), 0.1)
        packed = writer.compact(wire)
        kinds = ["copy" if type(item) is not int else "sent" for item in packed[6]]
        back = reader.expand(msgpack.unpackb(msgpack.packb(packed), use_list=False))
        assert back == wire
        assert type(back[6]) is tuple
    assert ", then ".join(dict.fromkeys(kinds)) == shape or shape == "interleaved"
    with pytest.raises(LogCorrupt):  # not an id, not a copy: refused on either path
        reader.expand((8, (1, 2, True)))
    with pytest.raises(LogCorrupt, match="outside the previous window"):
        reader.expand((8, ((5, 99), 1, 2)))
    with pytest.raises(LogCorrupt, match="outside the previous window"):
        reader.expand((14, "w", 3, 100, ((5, 99), 1, 2)))
    with pytest.raises(LogCorrupt, match="compact event tag 14"):
        reader.expand((14, "w", 3))


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
    from offload_fsm.log import snapshot
    from offload_fsm.log.snapshot_pack import compact_snapshot, expand_snapshot
    from offload_fsm.state import new_state
    from offload_fsm.testing.synthetic import default_config

    state = new_state(default_config(), world_size=2)
    base = 1 << 40  # keys are 64-bit fingerprints
    state.stored_keys = dict.fromkeys(range(base, base + 3000))
    first, keys = compact_snapshot(snapshot.take(state), None)
    assert first == snapshot.take(state)  # the file's first: whole
    for key in range(base, base + 50):
        del state.stored_keys[key]
    state.stored_keys.update(dict.fromkeys(range(base + 9000, base + 9020)))
    second, _ = compact_snapshot(snapshot.take(state), keys)
    assert len(msgpack.packb(second)) < len(msgpack.packb(first)) // 4
    back, _ = expand_snapshot(msgpack.unpackb(msgpack.packb(second), use_list=False), keys)
    assert back == snapshot.take(state)
    with pytest.raises(LogCorrupt, match="earlier snapshot"):
        expand_snapshot(second, None)
    del state.stored_keys[base + 300]  # out of the middle: whole again
    third, _ = compact_snapshot(snapshot.take(state), keys)
    assert third == snapshot.take(state)


def test_a_snapshot_packed_as_it_is_walked_is_the_same_bytes() -> None:
    """``log.snapshot_pack.packed_snapshot`` (the writer's snapshots) is the packed
    ``compact_snapshot`` of ``to_wire``, record for record, keys delta and
    all, along a real scheduler's run (shared prompts: op records in runs
    and references); and its SNAPSHOT record is the same too."""
    from bench.bench_fold import read_events
    from offload_fsm.log import snapshot
    from offload_fsm.log.records import encode_packed_snapshot, encode_snapshot
    from offload_fsm.log.snapshot_pack import compact_snapshot, packed_snapshot
    from offload_fsm.log.wire import packb
    from offload_fsm.machine import step
    from offload_fsm.state import new_state
    from replay.runner import config_of

    header, events = read_events(str(Path(__file__).parents[1] / "data" / "sim_logs" /
                                     "sim-ea-3"), None)
    assert header is not None
    state = new_state(config_of(header), world_size=header.world_size)
    keys: tuple[object, ...] | None = None
    compacted = 0
    for index, event in enumerate(events[:3000]):
        step(state, event)
        if index % 100:
            continue
        plain = snapshot.take(state)
        wire, whole_keys = compact_snapshot(plain, keys)
        packed, packed_keys = packed_snapshot(state, keys)
        assert packed == packb(wire), index
        assert packed_keys == whole_keys
        for level in (0, 6):
            assert encode_packed_snapshot(index, 7, "d", packed, level=level) == \
                encode_snapshot(index, 7, "d", wire, level=level)
        keys = whole_keys
        compacted += wire[4] != plain[4]  # op records in runs or references
    assert compacted > 10


def test_a_snapshot_packed_as_it_is_walked_keeps_the_young_generation_small() -> None:
    """A backlog's records, alive all at once, make the cyclic GC's young
    collections come due on the heap vLLM's scheduler thread shares; packed
    one at a time, they die as they are made."""
    import gc

    from offload_fsm.log import snapshot
    from offload_fsm.log.snapshot_pack import compact_snapshot, packed_snapshot
    from offload_fsm.log.wire import packb
    from offload_fsm.machine import step
    from offload_fsm.state import OpStatus, new_state
    from offload_fsm.testing.synthetic import default_config, run_workload

    config = default_config()
    world = run_workload(requests=400, seed=2, config=config, pool_blocks=20_000,
                         concurrency=40, max_chunks=8, fail_rate=0.0)
    state = new_state(config, world_size=world.state.world_size)
    for event, _ in world.applied:  # to a backlog of over a thousand buffered ops
        step(state, event)
        if state.live_ops[OpStatus.BUFFERED] > 1000:
            break
    assert state.live_ops[OpStatus.BUFFERED] > 1000
    collections = [0]

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and info["generation"] == 0:
            collections[0] += 1

    def young_collections(pack: object) -> int:
        gc.collect()
        collections[0] = 0
        gc.callbacks.append(count)
        try:
            pack()  # type: ignore[operator]
        finally:
            gc.callbacks.remove(count)
        return collections[0]

    whole = young_collections(lambda: packb(compact_snapshot(snapshot.take(state), None)[0]))
    walked = young_collections(lambda: packed_snapshot(state, None))
    assert whole >= 4 and walked <= whole // 4, (whole, walked)


def _offer(req: str, ids: tuple[int, ...], hashes: dict[int, int]) -> tuple[object, ...]:
    return (2, req, 0, 32 * len(ids), ids, tuple(hashes[b] for b in ids), 0.5, 4)


def _prefix_hits(rng: random.Random, count: int) -> list[tuple[object, ...]]:
    """Offers with shared prompts: each request re-offers one of three
    shared prompts (a prefix-cache hit on the same blocks), then its own blocks."""
    hashes = {b: rng.getrandbits(64) for b in range(600)}
    prompts = [tuple(rng.sample(range(300), 24)) for _ in range(3)]
    out = []
    for n in range(count):
        own = tuple(rng.sample(range(300, 600), rng.randint(0, 9)))
        prompt = rng.choice(prompts)[: rng.randint(1, 24)]
        out.append(_offer(f"r{n}", prompt + own, hashes))
        if rng.random() < 0.2:  # a block reallocated: new content, new hash
            hashes[rng.randrange(600)] = rng.getrandbits(64)
    return out


@pytest.mark.parametrize("seed", range(5))
def test_block_id_runs_round_trip_and_shrink_shared_prefixes(seed: int) -> None:
    writer, reader = WireContext(), WireContext()
    plain = compact = runs = 0
    for wire in _prefix_hits(random.Random(seed), 200):
        packed = writer.compact(wire)
        runs += sum(type(item) is tuple for item in packed[4])  # type: ignore[attr-defined]
        plain += len(msgpack.packb(wire))
        compact += len(msgpack.packb(packed))
        assert reader.expand(msgpack.unpackb(msgpack.packb(packed), use_list=False)) == wire
    assert runs > 100
    assert compact < plain * 0.4


def test_a_block_id_run_the_reader_cannot_follow_raises() -> None:
    hashes = dict.fromkeys(range(10), 1 << 40)
    writer, reader = WireContext(), WireContext()
    first, second = _offer("a", (1, 2, 3, 4), hashes), _offer("b", (1, 2, 3, 9), hashes)
    reader.expand(writer.compact(first))
    packed = writer.compact(second)
    assert packed[4] == ((1, 3), 9)
    reader.lose()
    with pytest.raises(LogCorrupt, match="block-id run against records lost"):
        reader.expand(packed)
    with pytest.raises(LogCorrupt, match="block 1 is in no list before"):
        WireContext().expand((2, "b", 0, 128, ((1, 3), 9), (None,) * 4, 0.5, 4))
    with pytest.raises(LogCorrupt, match="past the end of the list it copies"):
        fresh = WireContext()
        fresh.expand(first)
        fresh.expand((2, "b", 0, 160, ((2, 4), 9), (None,) * 5, 0.5, 4))
    with pytest.raises(LogCorrupt, match="expected .block id, length >= 1"):
        WireContext().expand((2, "b", 0, 128, ((1, 0),), (), 0.5, 4))


def test_snapshot_ops_sharing_a_prefix_travel_as_references() -> None:
    from offload_fsm.log import snapshot
    from offload_fsm.log.snapshot_pack import compact_snapshot, expand_snapshot
    from offload_fsm.machine import step
    from offload_fsm.state import new_state
    from offload_fsm.testing.synthetic import default_config
    from offload_fsm.vocabulary.events import CandidateOffered, RequestArrived

    state = new_state(default_config(), world_size=1)
    prompt = tuple(range(100, 164))
    for n in range(20):  # every request re-offers the shared prompt, then its own blocks
        own = tuple(range(1000 + 8 * n, 1008 + 8 * n))
        ids = prompt + own
        step(state, RequestArrived(req_id=f"r{n}"))
        step(state, CandidateOffered(req_id=f"r{n}", start_token=0, end_token=32 * len(ids),
                                     block_ids=ids, block_hashes=tuple((1 << 40) + b for b in ids),
                                     time_s=1.0, blocks_per_chunk=8))
    wire = snapshot.take(state)
    packed, _ = compact_snapshot(wire, None)
    ops_at = 3 + 1  # (format, names, state, requests, ops, batches)
    assert len(msgpack.packb(packed[ops_at])) < len(msgpack.packb(wire[ops_at])) // 3
    back, _ = expand_snapshot(msgpack.unpackb(msgpack.packb(packed), use_list=False), None)
    assert back == wire
    assert len(state.owners[100]) == 20  # type: ignore[arg-type]  # all 20 share the prompt


def _compact_forms_in(path: Path) -> tuple[int, int]:
    """(block-id runs in offers, hash references in snapshot ops) of a file, read raw."""
    import zlib

    from offload_fsm.log.snapshot_pack import op_columns

    inflater, runs, refs = Inflater(), 0, 0
    for frame in scan(path.read_bytes()):
        if not isinstance(frame, Record):
            continue
        kind = payload_kind(frame.payload)
        if kind == SNAPSHOT:
            inflater.reset()
            state = msgpack.unpackb(zlib.decompress(msgpack.unpackb(frame.payload)[4]),
                                    strict_map_key=False)
            at, _, hashes_at = op_columns(state)
            refs += sum(value is True for row in state[at] for value in row[hashes_at])
        elif kind == BATCH:
            for payload in inflater.payloads(msgpack.unpackb(frame.payload)[3]):
                for event in msgpack.unpackb(payload, strict_map_key=False)[3::2]:
                    if isinstance(event, list) and event and event[0] == 2:
                        runs += sum(isinstance(item, list) for item in event[4])
    return runs, refs


def test_a_real_schedulers_log_recorded_again_uses_runs_and_references(tmp_path: Path) -> None:
    from connector.recorder.recording import EventRecorder
    from replay.runner import config_of
    from testkit.rerecord import rerecord

    source = Path(__file__).parents[1] / "data" / "sim_logs" / "sim-ea-3"
    recorder, state, count = rerecord(source, lambda header: EventRecorder(
        config_of(header), header.world_size, str(tmp_path), {"package": "test"},
        prefix="again", snapshot_every=500, register_atexit=False), limit_events=1500)
    recorder.close(state)
    path = tmp_path / "again-000000.lolog"
    runs, refs = _compact_forms_in(path)
    assert runs > 50 and refs > 1000
    result = replay(tmp_path)
    assert result.ok and result.ended_cleanly and result.events_applied == count == 1500
    assert result.snapshots_checked >= 2
    events = [e for entry in read_file(path) if hasattr(entry, "record")
              and hasattr(entry.record, "events") for e in entry.record.events]
    source_events = [e for entry in read_file(next(source.glob("*.lolog")))
                     if hasattr(entry, "record") and hasattr(entry.record, "events")
                     for e in entry.record.events][:1500]
    assert events == source_events


def test_the_schema_5_golden_log_holds_runs_and_references() -> None:
    golden = Path(__file__).parents[1] / "data" / "logs" / "v5" / "golden-000000.lolog"
    runs, refs = _compact_forms_in(golden)
    assert runs > 100 and refs > 1000


@pytest.mark.parametrize("level", [0, 6])
def test_each_segment_index_is_keyed_with_the_bodies_the_segment_holds(
        tmp_path: Path, level: int) -> None:
    from offload_fsm.log.decode import LogDecoder
    from testkit.logedit import rekeyed

    directory, _ = record_workload(tmp_path / "log", requests=80, seed=2, pool_blocks=48,
                                   concurrency=6, recorder_options={
                                       "snapshot_every": 150, "compress_level": level})
    payloads = [r.payload for r in scan((directory / "run-000000.lolog").read_bytes())
                if isinstance(r, Record)]
    assert rekeyed(payloads) == payloads  # the recorder keys each INDEX as documented
    decoder = LogDecoder()
    keys = [record.key for p in payloads for record in decoder.decode_all(p)
            if type(record).__name__ == "Index"]
    assert len(keys) >= 3 and None not in keys and len(set(keys)) == len(keys)


def test_reading_from_later_segments_resumes_from_the_keys_read_before(tmp_path: Path) -> None:
    from logfiles import scan as reader

    directory, _ = record_workload(tmp_path / "log", requests=120, seed=5, pool_blocks=64,
                                   concurrency=8, recorder_options={"snapshot_every": 150})
    path = directory / "run-000000.lolog"
    starts = [s.offset for s in segments(directory) if s.offset > 0]
    assert len(starts) >= 4

    def records(offset: int) -> list[object]:
        return [e.record for e in read_file(path, start_offset=offset) if hasattr(e, "record")]

    reader._KEYS_BEFORE.clear()
    cold = {offset: records(offset) for offset in starts[::-1]}  # each from a colder cache
    assert len(reader._KEYS_BEFORE) == len(starts)
    decoded = 0
    original = reader.LogDecoder.decode

    def counting(self: object, payload: bytes) -> object:
        nonlocal decoded
        decoded += 1
        return original(self, payload)  # type: ignore[arg-type]

    reader._KEYS_BEFORE.clear()
    reader.LogDecoder.decode = counting  # type: ignore[method-assign]
    try:
        warm = {offset: records(offset) for offset in starts}  # in order: one pass in all
    finally:
        reader.LogDecoder.decode = original  # type: ignore[method-assign]
    assert warm == cold
    assert decoded == len(starts) - 1  # each earlier snapshot decoded once, not again per read
    # Once read, a cached entry keeps the keys, not the whole state it came from.
    assert all(keys is None or keys._state is None for keys in reader._KEYS_BEFORE.values())


def test_lazy_snapshot_states_decode_in_order_when_used_and_refuse_when_damaged() -> None:
    import zlib

    from offload_fsm.log import snapshot
    from offload_fsm.log.decode import _inflated_state
    from offload_fsm.log.snapshot_pack import KeysOf, LazyState, compact_snapshot
    from offload_fsm.state import new_state
    from offload_fsm.testing.synthetic import default_config

    state = new_state(default_config(), world_size=2)
    base = 1 << 40
    wires, raws, keys = [], [], None
    for round_ in range(4):  # each snapshot's keys a delta against the one before
        state.stored_keys.update(dict.fromkeys(range(base + 100 * round_,
                                                     base + 100 * round_ + 100)))
        wires.append(snapshot.take(state))
        compact, keys = compact_snapshot(wires[-1], keys)
        raws.append(zlib.compress(msgpack.packb(compact)))
    chain: list[LazyState] = []
    for raw in raws:
        chain.append(LazyState(raw, chain[-1] if chain else None, _inflated_state))
    assert "lazy" in repr(chain[-1])
    assert chain[-1].wire() == wires[-1]  # decodes the three before it first, oldest first
    assert all(lazy == wire for lazy, wire in zip(chain, wires, strict=True))
    assert chain[0] != chain[1] and chain[0] != "a string"

    damaged: list[LazyState] = []
    for index, raw in enumerate(raws):
        raw = raw[:10] + b"\x00" * 8 + raw[18:] if index == 1 else raw
        damaged.append(LazyState(raw, damaged[-1] if damaged else None, _inflated_state))
    assert damaged[0].wire() == wires[0]
    for _ in range(2):  # every time, and every snapshot keyed against the damaged one
        with pytest.raises(LogCorrupt):
            damaged[3].wire()
        with pytest.raises(LogCorrupt):
            damaged[1].keys()
    assert "failed" in repr(damaged[1])
    held = KeysOf(damaged[2])
    for _ in range(2):  # a cache entry over a damaged state refuses every time too
        with pytest.raises(LogCorrupt):
            held.keys()
    kept = KeysOf(chain[2])
    assert kept.keys() == chain[2].keys() and kept._state is None  # then holds keys alone


def test_verify_folding_through_snapshots_never_decodes_their_states(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from offload_fsm.log import decode as logdecode
    from replay import seek

    directory, _ = record_workload(tmp_path / "log", requests=120, seed=5, pool_blocks=64,
                                   concurrency=8, recorder_options={"snapshot_every": 150})
    inflated = 0
    original = logdecode._inflated_state

    def counting(data: bytes) -> object:
        nonlocal inflated
        inflated += 1
        return original(data)

    monkeypatch.setattr(logdecode, "_inflated_state", counting)
    result = replay(directory)
    assert result.ok and result.snapshots_checked >= 4, result
    assert inflated == 0  # each snapshot checked by its digest against the live state
    later = [s for s in segments(directory) if s.offset > 0][-1]
    restored = seek.replay_from([later.path], later, None, lambda fold: False)
    assert restored is not None and restored.ok and restored.snapshots_loaded == [later.seq]
    assert inflated >= 2  # a restore decodes its snapshot and the ones its keys refer to


_BLOCK = st.integers(0, 7)
_HASH = st.one_of(st.none(), st.integers(0, 3))


def test_hash_references_resolve_to_what_was_sent_one_by_one() -> None:
    """``refer`` then ``resolve`` of an offer gives back its hashes and leaves
    both tables alike, whatever its shape: blocks listed twice, a hash of 1
    (equal to ``True``), None, referred blocks before, after or among sent ones."""
    @settings(max_examples=400, deadline=None)
    @given(table=st.dictionaries(_BLOCK, _HASH),
           offer=st.lists(st.tuples(_BLOCK, _HASH), max_size=12))
    def round_trip(table: dict[int, int | None], offer: list[tuple[int, int | None]]) -> None:
        ids = tuple(block for block, _ in offer)
        hashes = tuple(value for _, value in offer)
        written, read = dict(table), dict(table)
        refs = refer(ids, hashes, written)

        def known(block_id: int) -> object:
            return read[block_id]

        assert resolve(ids, refs, read, known) == hashes
        assert read == written

    round_trip()
