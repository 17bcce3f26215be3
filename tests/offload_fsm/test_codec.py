"""The wire encoder (``log.wire``): every event, decision and command
round-trips; the tag table and each type's wire layout (field order) are
frozen; bad input raises."""

from __future__ import annotations

import enum
import types
import typing
from typing import Any

import attrs
import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offload_fsm import LogCorrupt
from offload_fsm.log.wire import from_wire, packb, to_wire, unpackb
from offload_fsm.vocabulary.commands import COMMAND_TYPES
from offload_fsm.vocabulary.decisions import (
    DECISION_TYPES,
    DropCause,
    FlushTrigger,
    HoldReason,
    IgnoreReason,
    RejectReason,
    SelectReason,
    SplitReason,
)
from offload_fsm.vocabulary.errors import UnknownTag
from offload_fsm.vocabulary.events import EVENT_TYPES


def encode(message: Any) -> bytes:
    return packb(to_wire(message))


def decode(data: bytes) -> Any:
    return from_wire(unpackb(data))

ALL_TYPES = (*EVENT_TYPES, *DECISION_TYPES, *COMMAND_TYPES)

# tag -> (class name, wire field order). Renumbering a tag or changing a
# field list must fail here: old logs would decode wrongly.
WIRE_TABLE: dict[int, tuple[str, tuple[str, ...]]] = {
    1: ("RequestArrived", ("req_id",)),
    2: ("CandidateOffered",
        ("req_id", "start_token", "end_token", "block_ids", "block_hashes", "time_s",
         "blocks_per_chunk")),
    3: ("StepScheduled",
        ("scheduled_tokens", "allocated_blocks", "next_step_blocks", "reserve_blocks",
         "free_blocks", "window_block_ids", "reallocated", "time_s")),
    4: ("RequestFinished", ("req_id", "free_blocks", "next_step_max_blocks")),
    5: ("RequestPreempted", ("req_id",)),
    6: ("ReceiptsArrived", ("completed", "failed")),
    7: ("HashesRead", ("batch_id", "block_hashes")),
    8: ("FreeQueueRead", ("window_block_ids",)),
    9: ("PrefixCacheReset", ()),
    10: ("ShutdownRequested", ()),
    11: ("ChunksMissing", ("chunk_keys",)),
    12: ("ShutdownBegan", ("time_s",)),
    13: ("StepsPassed", ("steps",)),
    14: ("LookupAnswered", ("req_id", "allocation_blocks", "free_blocks", "window_block_ids")),
    100: ("OpRejected", ("req_id", "start_token", "end_token", "reason")),
    101: ("OpsSelected",
          ("req_id", "batch_id", "start_token", "end_token", "ops", "reason", "rank")),
    102: ("OpsDropped",
          ("req_id", "start_token", "end_token", "ops", "tokens", "cause", "block_id")),
    103: ("StoreSubmitted",
          ("req_id", "batch_id", "start_token", "end_token", "ops", "blocks")),
    104: ("StoreSettled", ("req_id", "batch_id", "ops", "tokens", "failed", "orphaned")),
    105: ("OpsHeld", ("req_id", "ops", "reason")),
    106: ("ReceiptIgnored", ("req_id", "count", "failed", "reason")),
    107: ("OpsShielded", ("req_id", "ops", "blocks", "free_blocks", "reach_blocks")),
    108: ("BatchOrphaned", ("req_id", "batch_id")),
    109: ("ShieldLifted", ("req_id", "ops", "blocks")),
    110: ("StoreAbandoned", ("req_id", "batch_id", "ops", "tokens", "receipts", "waited_s")),
    111: ("StoredChunksForgotten", ("chunk_keys", "reported")),
    112: ("OpSplit",
          ("req_id", "start_token", "split_token", "end_token", "front_blocks", "reason")),
    113: ("TailFlushed", ("trigger", "requests", "ops", "tokens", "idle_steps")),
    114: ("ShutdownFlushBegan", ("until_s",)),
    115: ("ShutdownLeft",
          ("requests", "buffered_ops", "buffered_tokens", "in_flight_ops", "in_flight_tokens")),
    200: ("ProtectBlocks", ("batch_id", "block_ids")),
    201: ("ReadHashes", ("batch_id", "block_ids")),
    202: ("SubmitStore", ("batch_id", "req_id", "start_token", "end_token", "block_ids")),
    203: ("ReleaseBlocks", ("batch_id", "block_ids")),
    204: ("EndSession", ("req_id",)),
    205: ("ReadFreeQueue", ("depth_blocks",)),
}

ENUM_VALUES: dict[type[enum.Enum], tuple[str, ...]] = {
    RejectReason: ("unhashed", "prefix_broken", "already_stored"),
    SelectReason: ("window", "cascade", "shielded", "overdue", "fifo", "idle_flush",
                   "shutdown_flush"),
    DropCause: ("evicted", "preempted", "id_reuse", "store_failed", "stale", "cache_reset",
                "shutdown", "duplicate"),
    HoldReason: ("drain_cap", "pin_budget", "in_flight", "claimed"),
    IgnoreReason: ("unknown_request", "excess_count", "lease_expired"),
    FlushTrigger: ("idle", "shutdown"),
    SplitReason: ("pin_budget", "shield"),
}


def test_tag_table_is_exact_and_unique() -> None:
    actual = {
        cls.TAG: (cls.__name__, tuple(f.name for f in attrs.fields(cls))) for cls in ALL_TYPES
    }
    assert len(actual) == len(ALL_TYPES)  # unique tags
    assert actual == WIRE_TABLE


def test_tag_ranges_by_kind() -> None:
    assert all(1 <= cls.TAG <= 99 for cls in EVENT_TYPES)
    assert all(100 <= cls.TAG <= 199 for cls in DECISION_TYPES)
    assert all(200 <= cls.TAG <= 299 for cls in COMMAND_TYPES)


def test_enum_wire_values_are_stable() -> None:
    for enum_type, values in ENUM_VALUES.items():
        assert tuple(member.value for member in enum_type) == values


# -- one Hypothesis strategy per type, derived from its field types ------------

INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
HASH64 = st.integers(min_value=-(2**63), max_value=2**64 - 1)  # signed or unsigned fingerprints
TEXT = st.text(max_size=12)
FLOAT = st.floats(allow_nan=False)


def strategy_for(tp: Any, name: str) -> st.SearchStrategy[Any]:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is int:
        return HASH64 if "hash" in name else INT64
    if tp is str:
        return TEXT
    if tp is float:
        return FLOAT
    if tp is bool:
        return st.booleans()
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return st.sampled_from(tp)
    if origin in (types.UnionType, typing.Union):
        return st.one_of(*(strategy_for(a, name) for a in args))
    if tp is type(None):
        return st.none()
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return st.lists(strategy_for(args[0], name), max_size=6).map(tuple)
        return st.tuples(*(strategy_for(a, name) for a in args))
    raise AssertionError(f"no strategy for field {name}: {tp!r}")


def builds(cls: type) -> st.SearchStrategy[Any]:
    hints = typing.get_type_hints(cls)
    return st.builds(cls, **{f.name: strategy_for(hints[f.name], f.name)
                             for f in attrs.fields(cls)})


@pytest.mark.parametrize("cls", ALL_TYPES, ids=lambda c: c.__name__)
def test_every_type_round_trips(cls: type) -> None:
    @settings(max_examples=300)  # per type; 25 types
    @given(builds(cls))
    def round_trip(message: Any) -> None:
        data = encode(message)
        back = decode(data)
        assert type(back) is cls
        assert back == message
        assert encode(back) == data
        assert to_wire(message)[0] == cls.TAG

    round_trip()


def test_tuples_come_back_as_tuples_and_enums_as_members() -> None:
    from offload_fsm.vocabulary.decisions import OpsDropped
    from offload_fsm.vocabulary.events import StepScheduled

    event = StepScheduled(scheduled_tokens=1, allocated_blocks=2, next_step_blocks=3,
                          reserve_blocks=1, free_blocks=4, window_block_ids=(5, 6),
                          reallocated=((7, None), (8, 2**64 - 1)), time_s=0.25)
    back = decode(encode(event))
    assert isinstance(back.window_block_ids, tuple)
    assert back.reallocated == ((7, None), (8, 2**64 - 1))
    dropped = OpsDropped(req_id="r", start_token=0, end_token=64, ops=1, tokens=64,
                         cause=DropCause.STALE, block_id=-1)
    assert to_wire(dropped)[6] == "stale"
    assert decode(encode(dropped)).cause is DropCause.STALE


@pytest.mark.parametrize("tag", [0, 15, 99, 116, 199, 206, 299, 300, -1, 2**40])
def test_unknown_tag_raises_unknown_tag(tag: int) -> None:
    data = msgpack.packb([tag, "x"], use_bin_type=True)
    with pytest.raises(UnknownTag) as raised:
        decode(data)
    assert raised.value.tag == tag
    assert isinstance(raised.value, LogCorrupt)
    with pytest.raises(UnknownTag):
        from_wire((tag,))


@pytest.mark.parametrize(
    "item",
    [
        [],  # empty message
        [1],  # too few fields
        [1, "a", "b"],  # too many fields
        [102, "r", 0, 64, 1, 64, "no-such-cause", -1],  # bad enum value
    ],
)
def test_malformed_messages_raise_log_corrupt(item: list[Any]) -> None:
    with pytest.raises(LogCorrupt):
        decode(msgpack.packb(item, use_bin_type=True))
