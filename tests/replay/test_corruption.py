"""Every ``replay`` subcommand on a truncated or bit-flipped log: a clear
``damage:`` line on stderr naming file and offset, exit code 3
(corruption), and every intact record before the damage used. (``tail``
reads a live ZeroMQ stream, not files: framing damage there is the
framing tests' business.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from logfiles.scan import Entry, LogDamage, read_file
from offload_fsm.digest import state_digest
from offload_fsm.log.records import Inputs
from offload_fsm.machine import step
from offload_fsm.state import new_state
from offload_fsm.vocabulary.counters import Counter
from offload_fsm.vocabulary.events import StepScheduled
from replay.cli import EXIT_CORRUPT
from replay.runner import config_of, replay
from tests.replay.conftest import record_workload, run_cli


@pytest.fixture
def log(tmp_path: Path) -> Path:
    directory, _ = record_workload(tmp_path / "log", requests=60, seed=5, pool_blocks=64,
                                   concurrency=8,
                                   # one segment (folding cannot resume past the damage),
                                   # one frame per record (the damage hits one record)
                                   recorder_options={"digest_every": 50, "snapshot_every": 0,
                                                     "compress_level": 0})
    return directory / "run-000000.lolog"


def _damage(path: Path, how: str) -> Path:
    """Truncate mid-record, or flip bytes inside a record, about 60% in."""
    data = bytearray(path.read_bytes())
    entries = [e for e in read_file(path) if isinstance(e, Entry)]
    target = entries[len(entries) * 6 // 10]
    if how == "truncate":
        data = data[: target.offset + 20]
    else:
        for i in range(target.offset + 14, target.offset + 20):
            data[i] ^= 0xFF
    damaged = path.with_name(f"damaged-{how}-000000.lolog")
    damaged.write_bytes(bytes(data))
    return damaged


def _intact_prefix(path: Path) -> tuple[int, int, int]:
    """Events before the first damage; of them, token steps; and the number
    of records read after the damage: events of intact INPUTS records, and
    records reported as undecodable (schema 4 compact forms after damage in
    their segment)."""
    before, after, damaged = [], 0, False
    for entry in read_file(path):
        if isinstance(entry, LogDamage):
            after += damaged and entry.kind == "undecodable"
            damaged = True
        elif isinstance(entry.record, Inputs):
            if damaged:
                after += len(entry.record.events)
            else:
                before.extend(entry.record.events)
    assert damaged
    steps = sum(1 for e in before if isinstance(e, StepScheduled) and e.scheduled_tokens)
    return len(before), steps, after


def _fold(path: Path, count: int) -> str:
    header = next(e.record for e in read_file(path) if isinstance(e, Entry))
    state = new_state(config_of(header), world_size=header.world_size)
    events = [e for x in read_file(path) if isinstance(x, Entry)
              and isinstance(x.record, Inputs) for e in x.record.events][:count]
    for event in events:
        step(state, event)
    return state_digest(state)


HOW = ["truncate", "flip"]


@pytest.mark.parametrize("how", HOW)
def test_verify(log: Path, how: str) -> None:
    damaged = _damage(log, how)
    events, _, after = _intact_prefix(damaged)
    code, out, err = run_cli("verify", str(damaged), "--json")
    assert code == EXIT_CORRUPT
    data = json.loads(out)
    assert data["events_applied"] == events and data["divergence"] is None
    assert data["problems"] and str(damaged) in data["problems"][0]
    code, out, err = run_cli("verify", str(damaged))
    assert code == EXIT_CORRUPT
    assert err.startswith(f"damage: {damaged}@") and f"{events} events replayed" in out
    result = replay(damaged)
    assert state_digest(result.state) == _fold(damaged, events)  # type: ignore[arg-type]
    if how == "flip":
        assert after > 0  # the records past the damage were read (and reported as unusable)


@pytest.mark.parametrize("how", HOW)
def test_summary(log: Path, how: str) -> None:
    damaged = _damage(log, how)
    events, steps, _ = _intact_prefix(damaged)
    code, out, err = run_cli("summary", str(damaged), "--json")
    assert code == EXIT_CORRUPT and "damage: " in err
    assert json.loads(out)["token_steps"] == steps
    code, out, err = run_cli("summary", str(damaged))
    assert code == EXIT_CORRUPT and err.startswith("damage: ") and "ledger" in out


@pytest.mark.parametrize("how", HOW)
def test_explain(log: Path, how: str) -> None:
    damaged = _damage(log, how)
    code, out, err = run_cli("explain", str(damaged), "--request", "req-0", "--json")
    assert code == EXIT_CORRUPT and err.startswith("damage: ")
    story = json.loads(out)
    assert story["found"] and story["ops"]  # req-0 ran before the damage
    code, out, err = run_cli("explain", str(damaged), "--request", "req-0")
    assert code == EXIT_CORRUPT and "req-0" in out


@pytest.mark.parametrize("how", HOW)
def test_whatif(log: Path, how: str) -> None:
    damaged = _damage(log, how)
    _, steps, _ = _intact_prefix(damaged)
    code, out, err = run_cli("whatif", str(damaged), "--policy", "FIFO", "--json")
    assert code == EXIT_CORRUPT and "damage: " in err
    assert json.loads(out)["recorded"]["token_steps"] == steps
    code, out, err = run_cli("whatif", str(damaged), "--policy", "FIFO")
    assert code == EXIT_CORRUPT and "CAVEAT" in out


@pytest.mark.parametrize("how", HOW)
def test_timeline(log: Path, how: str, tmp_path: Path) -> None:
    damaged = _damage(log, how)
    _, steps, _ = _intact_prefix(damaged)
    output = tmp_path / "t.html"
    code, out, err = run_cli("timeline", str(damaged), "-o", str(output))
    assert code == EXIT_CORRUPT and err.startswith("damage: ")
    assert f"({steps} token steps in " in out and output.exists()


@pytest.mark.parametrize("command", ["verify", "summary", "explain", "whatif", "timeline"])
def test_a_damaged_header_leaves_nothing_to_replay(log: Path, command: str,
                                                   tmp_path: Path) -> None:
    data = bytearray(log.read_bytes())
    data[15] ^= 0xFF  # inside the header's payload
    damaged = tmp_path / "bad-000000.lolog"
    damaged.write_bytes(bytes(data))
    extra = {"explain": ["--request", "req-0"], "whatif": ["--policy", "FIFO"],
             "timeline": ["-o", str(tmp_path / "t.html")]}.get(command, [])
    code, _, err = run_cli(command, str(damaged), *extra)
    assert code == EXIT_CORRUPT
    assert "damage: " in err or "no header" in err


def test_damage_in_an_early_file_resumes_at_the_next_snapshot(tmp_path: Path) -> None:
    directory, world = record_workload(tmp_path / "rot", requests=200, seed=5,
                                       pool_blocks=64, concurrency=8,
                                       recorder_options={"max_file_bytes": 4_000})
    files = sorted(directory.glob("*.lolog"))
    assert len(files) >= 3
    data = bytearray(files[0].read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 8):
        data[i] ^= 0xFF
    files[0].write_bytes(bytes(data))
    result = replay(directory)
    assert result.damage and result.divergence is None
    assert result.snapshots_loaded  # folding went on from the second file's snapshot
    assert result.ended_cleanly and result.state is not None
    assert state_digest(result.state) == state_digest(world.state)
    assert result.state.counters[Counter.TOKEN_STEPS] == world.state.counters[
        Counter.TOKEN_STEPS]
    code, _, err = run_cli("verify", str(directory))
    assert code == EXIT_CORRUPT and err.startswith(f"damage: {files[0]}@")
