"""verify --workers: each file replays alone from its snapshot, the seams are
checked, and the verdict is the serial one."""

from __future__ import annotations

import io
from pathlib import Path

from replay.cli import main
from replay.parallel import replay_parallel
from replay.runner import replay
from tests.replay.conftest import record_rotated, record_workload


def test_parallel_verify_agrees_with_serial(tmp_path: Path) -> None:
    directory = record_rotated(tmp_path / "rot", requests=150)
    serial = replay(directory)
    for workers in (1, 2):
        parallel = replay_parallel(directory, workers=workers)
        assert parallel.ok, (parallel.divergence, parallel.damage, parallel.lost)
        assert parallel.events_applied == serial.events_applied
        assert parallel.ended_cleanly
    out = io.StringIO()
    assert main(["verify", str(directory), "--workers", "2"], out=out) == 0
    assert "OK" in out.getvalue()


def test_a_broken_seam_is_reported(tmp_path: Path) -> None:
    directory = record_rotated(tmp_path / "rot", requests=150)
    files = sorted(directory.glob("*.lolog"))
    files[1].unlink()  # the seam between files 0 and 2 no longer lines up
    result = replay_parallel(directory, workers=2)
    assert not result.ok
    assert any("starts at event" in lost for lost in result.lost), result.lost
    assert main(["verify", str(directory), "--workers", "2"], out=io.StringIO(),
                err=io.StringIO()) == 3


def test_one_file_splits_at_its_segments(tmp_path: Path) -> None:
    from replay.parallel import _units

    directory, _ = record_workload(tmp_path / "one", requests=150, seed=4, pool_blocks=64,
                                   concurrency=8, recorder_options={"snapshot_every": 150})
    assert len(list(directory.glob("*.lolog"))) == 1
    units = _units(directory, None)
    assert len(units) >= 4 and units[0][1] == 0 and all(u[1] > 0 for u in units[1:])
    assert [u[2] for u in units[:-1]] == sorted(u[2] for u in units[:-1])
    serial = replay(directory)
    parallel = replay_parallel(directory, workers=2)
    assert parallel.ok, (parallel.divergence, parallel.damage, parallel.lost)
    assert parallel.events_applied == serial.events_applied and parallel.ended_cleanly
    assert parallel.snapshots_checked == serial.snapshots_checked
