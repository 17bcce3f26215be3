"""Record format: round trips, outcome checks, versions and tags."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest

from offload_fsm.log import records as logformat
from offload_fsm.log import wire
from offload_fsm.log.decode import LogDecoder
from offload_fsm.log.records import SCHEMA_VERSION, Digest, End, Gap, Header, Inputs
from offload_fsm.testing.synthetic import run_workload
from offload_fsm.vocabulary import events
from offload_fsm.vocabulary.errors import LogCorrupt, SchemaTooNew, UnknownTag
from offload_fsm.vocabulary.outcome import Outcome
from tests.logrecords import decode_record, encode_record

EVERY_EVENT = (
    events.RequestArrived(req_id="r-1"),
    events.CandidateOffered(req_id="r-1", start_token=0, end_token=64, block_ids=(3, 4),
                     block_hashes=(2**63 + 5, None), time_s=1.25),
    events.StepScheduled(scheduled_tokens=64, allocated_blocks=2, next_step_blocks=2,
                  reserve_blocks=1, free_blocks=10, window_block_ids=(7, 8, 9),
                  reallocated=((3, 11), (4, None)), time_s=1.5),
    events.RequestFinished(req_id="r-1", free_blocks=12),
    events.RequestPreempted(req_id="r-2"),
    events.ReceiptsArrived(completed=(("r-1", 2), ("r-3", 1)), failed=("r-3",)),
    events.HashesRead(batch_id=4, block_hashes=(1, None, 2**64 - 1)),
    events.FreeQueueRead(window_block_ids=(1, 2)),
    events.PrefixCacheReset(),
    events.ShutdownRequested(),
    events.ChunksMissing(chunk_keys=(2**64 - 1, 7)),
    events.ShutdownBegan(time_s=2.5),
    events.StepsPassed(steps=((64, 2, 2, 1, 10, 0, 2.75), (1, 0, 1, 0, 10, 3, 3.0))),
    events.LookupAnswered(req_id="r-4", allocation_blocks=2, free_blocks=10,
                          window_block_ids=(7, 3, 8)),
)
EMPTY = Outcome(decisions=(), commands=())
HEADER = Header(seq=0, wall_time_s=1000.0, schema=SCHEMA_VERSION, config={"k": 1},
                policy="FIFO", world_size=2, versions={"package": "x"}, created_s=1000.0)


def test_every_event_type_is_covered() -> None:
    from offload_fsm.vocabulary.events import EVENT_TYPES

    assert {type(e) for e in EVERY_EVENT} == set(EVENT_TYPES)


@pytest.mark.parametrize("event", EVERY_EVENT, ids=lambda e: type(e).__name__)
def test_every_event_round_trips(event: Any) -> None:
    record = Inputs(seq=7, wall_time_s=1000.25, events=(event,), checks=(0,))
    back = decode_record(encode_record(record, created_s=1000.0), created_s=1000.0)
    assert back == record
    assert type(back.events[0]) is type(event)  # type: ignore[union-attr]
    assert hash(back.events[0]) == hash(event)  # type: ignore[union-attr]


def test_every_record_kind_round_trips() -> None:
    records = [
        HEADER,
        Inputs(seq=0, wall_time_s=1000.0, events=EVERY_EVENT,
               checks=tuple(range(len(EVERY_EVENT)))),
        Digest(seq=9, wall_time_s=1001.0, digest="00ff00ff00ff00ff"),
        Gap(seq=10, wall_time_s=1002.0, lost_count=3),
        End(seq=13, wall_time_s=1003.0, events_total=13, digest=""),
    ]
    decoder = LogDecoder()
    for record in records:
        assert decoder.decode(encode_record(record, created_s=1000.0)) == record


def test_wire_round_trips_and_checks_are_stable() -> None:
    world = run_workload(requests=40, seed=2, pool_blocks=48, concurrency=6)
    seen = set()
    for event, outcome in world.applied:
        assert wire.from_wire(wire.unpackb(wire.packb(wire.to_wire(event)))) == event
        for message in (*outcome.decisions, *outcome.commands):
            seen.add(type(message))
            assert wire.from_wire(wire.unpackb(wire.packb(wire.to_wire(message)))) == message
        check = wire.outcome_check(outcome)
        assert (check == 0) == (not outcome.decisions and not outcome.commands)
        assert check == wire.wire_check(wire.outcome_wire(outcome))
    assert len(seen) >= 8


def test_wire_tags_are_stable() -> None:
    """Renumbering breaks every recorded log: these values are forever."""
    assert (logformat.HEADER, logformat.INPUTS, logformat.DIGEST, logformat.GAP,
            logformat.END) == (1, 2, 3, 4, 5)
    assert [type(e).TAG for e in EVERY_EVENT] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                                 14]


def test_unknown_tags_and_bad_payloads() -> None:
    with pytest.raises(UnknownTag):
        decode_record(msgpack.packb([99, 0, 0]))
    with pytest.raises(UnknownTag):
        decode_record(msgpack.packb([2, 0, 0, [99, "x"], 0]))
    with pytest.raises(LogCorrupt):
        decode_record(b"\xc1")
    with pytest.raises(LogCorrupt):
        decode_record(msgpack.packb([2, 0, 0, [1, "a", "extra"], 0]))
    with pytest.raises(LogCorrupt):
        decode_record(msgpack.packb({"not": "an envelope"}))


def test_schema_too_new() -> None:
    payload = encode_record(
        Header(**{**_fields(HEADER), "schema": SCHEMA_VERSION + 1}), created_s=0.0)
    with pytest.raises(SchemaTooNew):
        decode_record(payload)
    with pytest.raises(SchemaTooNew):
        decode_record(msgpack.packb([4, 0, 0, 1]), schema=SCHEMA_VERSION + 1)


def _fields(header: Header) -> dict[str, Any]:
    import attrs

    return attrs.asdict(header)


def test_upcaster_chain_reads_a_synthetic_v0_log(monkeypatch: pytest.MonkeyPatch) -> None:
    """v0 (hypothetical): GAP carried a reason string after the count; v1 dropped it."""
    v0_header = msgpack.packb([1, 0, 1000.0, {**_body(), "schema": 0}])
    v0_gap = msgpack.packb([4, 5, 250, 3, "queue full"])
    with pytest.raises(LogCorrupt, match="no upcaster"):
        LogDecoder().decode(v0_header)

    def v0_to_v1(item: tuple[Any, ...]) -> tuple[Any, ...]:
        return item[:4] if item[0] == logformat.GAP else item

    monkeypatch.setitem(logformat.UPCASTERS, 0, v0_to_v1)
    decoder = LogDecoder()
    header = decoder.decode(v0_header)
    assert isinstance(header, Header) and header.schema == 0
    assert decoder.decode(v0_gap) == Gap(seq=5, wall_time_s=1000.25, lost_count=3)


def _body() -> dict[str, Any]:
    return {"config": {}, "policy": "FIFO", "world_size": 1, "versions": {},
            "created_s": 1000.0}


def test_bytes_per_event_is_small() -> None:
    world = run_workload(requests=200, seed=4)
    total = 0
    step_batch: list[Any] = []
    for event, outcome in world.applied:
        step_batch.append((event, outcome))
        if type(event) is events.StepScheduled:
            total += 12 + len(logformat.encode_inputs(0, 1000, step_batch))
            step_batch = []
    assert total / len(world.applied) <= 40
