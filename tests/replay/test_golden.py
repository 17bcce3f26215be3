"""Golden logs, one per schema version, kept forever: each must still decode
and replay clean. Changing a wire tag, a field list or a decision breaks this
loudly; the fix is a new schema version plus an upcaster, never an edit here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from replay.cli import main
from replay.runner import replay

LOGS = Path(__file__).parents[1] / "data" / "logs"
VERSIONS = sorted(p for p in LOGS.iterdir() if p.is_dir())


def test_there_is_a_golden_log_per_schema_version() -> None:
    from offload_fsm.log.records import SCHEMA_VERSION

    assert [p.name for p in VERSIONS] == [f"v{v}" for v in range(1, SCHEMA_VERSION + 1)]


@pytest.mark.parametrize("directory", VERSIONS, ids=lambda p: p.name)
def test_golden_log_replays_clean(directory: Path) -> None:
    expected = json.loads((directory / "expected.json").read_text())
    result = replay(directory)
    assert result.ok, (result.divergence, result.damage, result.lost)
    assert result.ended_cleanly
    assert result.events_applied == expected["events"]
    assert result.state is not None
    assert {k: v for k, v in result.state.counters.items() if v} == expected["counters"]
    assert main(["verify", str(directory)]) == 0
