"""Golden logs, one per schema version, kept forever: each must still decode
and replay clean. Changing a wire tag, a field list or a decision breaks this
loudly; the fix is a new schema version plus an upcaster, never an edit here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from replay.cli import main
from replay.reader import LogDamage, read_log
from replay.runner import replay

LOGS = Path(__file__).parents[1] / "data" / "logs"
VERSIONS = sorted(p for p in LOGS.iterdir() if p.is_dir())

# version -> (seq of the first outcome a deliberate rule change altered, why).
# The log must still decode whole and replay identically up to that event.
CHANGED_BY_RULES: dict[str, tuple[int, str]] = {
    # Issue 12, chunk-granularity selection: req-0 finishes with 0 free
    # blocks and a reserve of 1. The recording left it unshielded (the free
    # queue could not spare the reserve); now the shield protects the prefix
    # that leaves the reserve once the freed blocks join the queue: [0, 64)
    # and [64, 96), cut from [64, 128) (OpSplit shield), 3 of its 4 blocks.
    "v1": (35, "the shield protects the chunk prefix that leaves the reserve"),
    "v2": (35, "the shield protects the chunk prefix that leaves the reserve"),
    "v3": (35, "the shield protects the chunk prefix that leaves the reserve"),
}


def test_there_is_a_golden_log_per_schema_version() -> None:
    from offload_fsm.logformat import SCHEMA_VERSION

    assert [p.name for p in VERSIONS] == [f"v{v}" for v in range(1, SCHEMA_VERSION + 1)]


@pytest.mark.parametrize("directory", VERSIONS, ids=lambda p: p.name)
def test_golden_log_replays_clean(directory: Path) -> None:
    expected = json.loads((directory / "expected.json").read_text())
    result = replay(directory)
    if directory.name in CHANGED_BY_RULES:
        seq, why = CHANGED_BY_RULES[directory.name]
        assert result.divergence is not None, f"the rule ({why}) no longer changes seq {seq}"
        assert (result.divergence.seq, result.divergence.kind) == (seq, "outcome"), why
        assert not result.damage and not result.lost
        assert not [e for e in read_log(directory) if isinstance(e, LogDamage)]
        return
    assert result.ok, (result.divergence, result.damage, result.lost)
    assert result.ended_cleanly
    assert result.events_applied == expected["events"]
    assert result.state is not None
    assert {k: v for k, v in result.state.counters.items() if v} == expected["counters"]
    assert main(["verify", str(directory)]) == 0
