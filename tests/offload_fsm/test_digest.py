"""The digest covers the state: every field of the digested classes is
either digested or excluded with a reason, and a new field in neither
refuses to load."""

from __future__ import annotations

import attrs
import pytest

from offload_fsm import digest
from offload_fsm.state import WIRE_NAME, Batch, Op, RequestState, State


@pytest.mark.parametrize("cls", [State, RequestState, Op, Batch], ids=lambda c: c.__name__)
def test_every_field_is_digested_or_excluded_and_nothing_else(cls: type) -> None:
    digested, excluded = digest.coverage()[cls]
    fields = [field.metadata.get(WIRE_NAME, field.name) for field in attrs.fields(cls)]
    assert sorted(digested + excluded) == sorted(fields)
    assert set(digested).isdisjoint(excluded)


def test_a_field_in_neither_table_is_refused() -> None:
    @attrs.define
    class Grown:
        step_index: int = 0
        new_field: int = 0

    with pytest.raises(AssertionError, match=r"\['new_field'\] are neither digested nor excluded"):
        digest._check_complete(Grown, ("step_index",), ())


def test_a_name_that_is_no_longer_a_field_is_refused() -> None:
    @attrs.define
    class Shrunk:
        step_index: int = 0

    with pytest.raises(AssertionError, match=r"stale names \['gone'\]"):
        digest._check_complete(Shrunk, ("step_index",), ("gone",))


def test_every_digested_state_field_changes_the_digest() -> None:
    """A field the tables call digested really reaches the bytes."""
    from offload_fsm import OffloadConfig, new_state

    config = OffloadConfig(receipt_lease_s=300.0, idle_flush_steps=1)
    base = digest.state_digest(new_state(config, world_size=1))
    scalars = {"step_index": 7, "ema_blocks": 1.5, "peak_blocks": 2.0, "depth_blocks": 3,
               "next_step_blocks": 4, "reserve_blocks": 5, "pin_steps_ema": 2.0,
               "time_s": 9.0, "next_op_id": 1, "next_batch_id": 1, "next_order": 1,
               "stored_keys_xor": 11, "closed": "shut down", "idle_steps": 2,
               "shutdown_until_s": 3.0}
    for name, value in scalars.items():
        state = new_state(config, world_size=1)
        setattr(state, name, value)
        assert digest.state_digest(state) != base, name
