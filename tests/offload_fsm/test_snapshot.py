"""``offload_fsm.log.snapshot``: the state survives ``take``/``restore``
(through msgpack, as in a log) after every event of random runs, with its
object identity, and the rebuilt state goes on exactly like the original."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from offload_fsm.digest import state_digest
from offload_fsm.invariants import check_all
from offload_fsm.log import snapshot
from offload_fsm.log.wire import outcome_wire, packb, unpackb
from offload_fsm.machine import step
from offload_fsm.state import (
    DERIVED,
    WIRE_NAME,
    Batch,
    Op,
    RequestState,
    State,
    holders,
    new_state,
)
from offload_fsm.testing.synthetic import default_config, run_workload
from offload_fsm.vocabulary.config import Policy
from offload_fsm.vocabulary.errors import LogCorrupt


def _round_trip(state: State) -> State:
    return snapshot.restore(unpackb(packb(snapshot.take(state))), state.config)


def _check_identity(state: State) -> None:
    """Every reference points at the object the state holds, not a copy."""
    for rec in state.requests.values():
        for op in rec.ops:
            assert op.req is rec
        if rec.batch is not None:
            assert rec.batch.req is rec
            assert state.batches[rec.batch.batch_id] is rec.batch
    for req_id, rec in state.pending.items():
        assert state.requests.get(req_id) is rec or rec.batch is not None or rec.ops
    for batch in state.batches.values():
        for op in batch.ops:
            assert op.req is batch.req
    ops_by_id = {op.op_id: op for rec in state.requests.values() for op in rec.ops}
    for entry in state.owners.values():
        for op in holders(entry):
            if op.op_id in ops_by_id:
                assert ops_by_id[op.op_id] is op


def _owners_shape(state: State) -> list[tuple[int, tuple[int, ...] | None, tuple[int, ...]]]:
    """Each owners entry: its block, its dict's keys (None for a lone op), its ops' ids."""
    return [(block_id, None if isinstance(entry, Op) else tuple(entry),
             tuple(op.op_id for op in holders(entry)))
            for block_id, entry in state.owners.items()]


@pytest.mark.parametrize("policy", list(Policy))
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_round_trip_after_every_event_and_identical_continuation(policy: Policy,
                                                                 seed: int) -> None:
    config = default_config(policy)
    world = run_workload(requests=30, seed=seed, config=config, pool_blocks=48,
                         concurrency=6, max_chunks=4, fail_rate=0.1)
    applied = world.applied
    assert len(applied) > 100
    state = new_state(config, world_size=world.state.world_size)
    checkpoints = {len(applied) // 5 * k for k in range(1, 5)}
    for index, (event, recorded) in enumerate(applied):
        copy = _round_trip(state)
        assert state_digest(copy) == state_digest(state), index
        assert copy.owner_hashes == state.owner_hashes, index  # derived, not on the wire
        assert _owners_shape(copy) == _owners_shape(state), index  # holders in their order
        assert (copy.live_ops, copy.live_tokens) == (state.live_ops, state.live_tokens), index
        _check_identity(copy)
        if index in checkpoints:
            for later_event, later_recorded in applied[index:]:
                assert outcome_wire(step(copy, later_event)) == outcome_wire(later_recorded)
            assert state_digest(copy) == state_digest(world.state)
            assert check_all(copy) == [], index  # the live tallies went on with it
        outcome = step(state, event)
        assert outcome_wire(outcome) == outcome_wire(recorded)
    assert state_digest(_round_trip(state)) == state_digest(world.state)


def test_shared_objects_stay_shared() -> None:
    world = run_workload(requests=12, seed=4, pool_blocks=40, concurrency=6, max_chunks=4)
    state = new_state(world.state.config, world_size=2)
    shared_seen = False
    for event, _ in world.applied:
        step(state, event)
        copy = _round_trip(state)
        _check_identity(copy)
        for entry in copy.owners.values():
            for op in holders(entry):
                assert any(op is o for rec in copy.requests.values() for o in rec.ops) or any(
                    op is o for b in copy.batches.values() for o in b.ops)
                shared_seen = True
    assert shared_seen


def test_every_field_of_every_record_class_is_on_the_wire() -> None:
    """A field added to a state class later travels without a change to
    log/snapshot.py (the codec is derived from the attrs fields). Only the
    config (in the header) and the derived indexes stay off; a field with a
    wire name travels under it."""
    names = dict(snapshot.take(new_state(default_config(), world_size=1))[1])
    for cls in (State, RequestState, Op, Batch):
        expected = [f.metadata.get(WIRE_NAME, f.name) for f in attrs.fields(cls)
                    if f.name != "config" and f.name not in DERIVED]
        assert list(names[cls.__name__]) == expected
    assert names["Op"][4:6] == ("block_ids", "block_hashes")  # not the packed fields' names


def test_an_older_snapshot_without_a_field_takes_its_default() -> None:
    world = run_workload(requests=6, seed=2, pool_blocks=24, concurrency=3, max_chunks=3)
    wire = list(snapshot.take(world.state))
    names = dict(wire[1])
    state_fields = list(names["State"])
    drop = state_fields.index("peak_blocks")
    names["State"] = tuple(n for n in state_fields if n != "peak_blocks")
    wire[1] = tuple(names.items())
    wire[2] = tuple(v for i, v in enumerate(wire[2]) if i != drop)
    restored = snapshot.restore(tuple(wire), world.state.config)
    assert restored.peak_blocks == 0.0


def test_counters_added_later_start_at_zero_in_declaration_order() -> None:
    state = new_state(default_config(), world_size=1)
    wire: list[Any] = list(snapshot.take(state))
    names = dict(wire[1])
    at = list(names["State"]).index("counters")
    body = list(wire[2])
    body[at] = body[at][:3]  # a snapshot from before the later counters existed
    wire[2] = tuple(body)
    restored = snapshot.restore(tuple(wire), state.config)
    assert list(restored.counters) == list(state.counters)


def test_owners_travel_flat_and_format_1_snapshots_still_restore() -> None:
    from pathlib import Path

    from logfiles.scan import Entry, read_log
    from offload_fsm.log.records import Header, Snapshot
    from replay.runner import config_of

    # The v5 golden log (a real scheduler's, with shared prefixes) holds format 1 snapshots.
    golden = Path(__file__).parents[1] / "data" / "logs" / "v5"
    header, shared = None, 0
    for entry in read_log(golden):
        record = entry.record if isinstance(entry, Entry) else None
        if isinstance(record, Header) and header is None:
            header = record
        if not isinstance(record, Snapshot) or header is None:
            continue
        assert record.wire()[0] == 1
        old = snapshot.restore(record.wire(), config_of(header))
        assert state_digest(old) == record.digest
        wire = snapshot.take(old)
        assert wire[0] == snapshot.SNAPSHOT_FORMAT == 2
        owners = wire[2][list(dict(wire[1])["State"]).index("owners")]
        assert len(owners) == 4  # blocks, counts, keys, refs: flat ints, no tuple per block
        assert all(type(value) is int for column in owners for value in column)
        assert _owners_shape(_round_trip(old)) == _owners_shape(old)
        shared += sum(not isinstance(entry, Op) for entry in old.owners.values())
    assert shared  # blocks held by several ops (dict entries) went through both forms


@pytest.mark.parametrize("damage", ["short", "format", "unknown_field", "bad_ref",
                                    "owners", "owners_extra", "op_hash_past_64_bits",
                                    "op_block_id_not_an_int"])
def test_malformed_snapshots_raise_log_corrupt(damage: str) -> None:
    world = run_workload(requests=6, seed=2, pool_blocks=24, concurrency=3, max_chunks=3)
    state = new_state(world.state.config, world_size=2)
    for event, _ in world.applied[: len(world.applied) // 2]:
        step(state, event)
    assert state.requests
    wire: list[Any] = list(snapshot.take(state))
    if damage == "short":
        wire = wire[:3]
    elif damage == "format":
        wire[0] = 99
    elif damage == "unknown_field":
        names = dict(wire[1])
        names["Op"] = (*names["Op"], "from_the_future")
        wire[1] = tuple(names.items())
    elif damage == "owners":
        at = list(dict(wire[1])["State"]).index("owners")
        body = list(wire[2])
        blocks, counts, keys, refs = body[at]
        body[at] = (blocks, counts, keys, refs[:-1])  # one holder short
        wire[2] = tuple(body)
    elif damage == "owners_extra":
        at = list(dict(wire[1])["State"]).index("owners")
        body = list(wire[2])
        blocks, counts, keys, refs = body[at]
        body[at] = (blocks, counts, (*keys, keys[0]), (*refs, refs[0]))  # a holder of no block
        wire[2] = tuple(body)
    elif damage.startswith("op_"):  # an op's packed ints: each value must fit 64 bits
        field = "block_hashes" if "hash" in damage else "block_ids"
        at = list(dict(wire[1])["Op"]).index(field)
        first = list(wire[4][0])
        first[at] = (1 << 64, *first[at][1:]) if "hash" in damage else ("7", *first[at][1:])
        wire[4] = (tuple(first), *wire[4][1:])
    else:
        wire[3] = ()  # requests table gone, references dangle
    with pytest.raises(LogCorrupt):
        snapshot.restore(tuple(wire), state.config)
