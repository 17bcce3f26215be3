"""Disk use of the event log: every file replays alone (header + snapshot),
the directory stays within its bound, a full disk costs events but not the
log, and a bad log directory is handled at start-up."""

from __future__ import annotations

import builtins
import errno
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from connector.recorder import files as log_files
from connector.recorder import writer as eventlog
from connector.recorder.recording import EventRecorder
from logfiles.scan import read_file
from offload_fsm.log.framing import scan
from offload_fsm.log.records import Gap, Header, Inputs, Snapshot
from offload_fsm.state import State
from offload_fsm.testing.synthetic import default_config, run_workload
from offload_fsm.vocabulary.config import Settings, ShellConfig
from offload_fsm.vocabulary.events import Event, StepScheduled, StepsPassed
from offload_fsm.vocabulary.outcome import Outcome
from replay.cli import main
from replay.runner import replay
from testkit.pacing import paced
from tests.connector.plain_encoder import PlainEncoder

VERSIONS = {"package": "test", "vllm": "", "lmcache": ""}


def _recorder(directory: Path, prefix: str = "run", **options: Any) -> EventRecorder:
    return EventRecorder(default_config(), 2, str(directory), VERSIONS, prefix=prefix,
                         register_atexit=False, **options)


def _plain() -> PlainEncoder:
    return PlainEncoder(lambda item: item, lambda: b"H", lambda n: b"G")


def _records(path: Path) -> list[Any]:
    return [entry.record for entry in read_file(path) if hasattr(entry, "record")]


def _verify(path: Path) -> int:
    return main(["verify", str(path)], out=open(os.devnull, "w"), err=open(os.devnull, "w"))


# --------------------------------------------------------------------------
# Every file replays alone.


def test_every_file_after_the_first_starts_with_header_then_snapshot(tmp_path: Path) -> None:
    # Rotation's snapshots only (no periodic ones, see the index tests).
    recorder = _recorder(tmp_path, max_file_bytes=4_000, digest_every=100, snapshot_every=0)
    world = run_workload(requests=200, seed=5, pool_blocks=64, concurrency=8,
                         sink=paced(recorder))
    recorder.close(world.state)
    files = sorted(tmp_path.glob("*.lolog"))
    assert len(files) >= 4
    assert recorder.snapshots == len(files) - 1
    for index, path in enumerate(files):
        kinds = [type(r) for r in _records(path)]
        assert kinds[0] is Header
        assert Header not in kinds[1:]
        if index:
            assert kinds[1] is Snapshot
            assert Snapshot not in kinds[2:]
            header, snap = _records(path)[:2]
            assert header.seq == snap.seq
        else:
            assert Snapshot not in kinds
    whole = replay(tmp_path)
    assert whole.ok and whole.ended_cleanly and whole.events_applied == len(world.applied)
    assert whole.snapshots_checked == len(files) - 1
    for path in files[1:]:
        alone = replay(path)
        assert alone.ok, (path.name, alone.lost, alone.damage, alone.divergence)
        assert alone.snapshots_loaded == [alone.first_seq]
        assert alone.first_seq + alone.events_applied == (
            whole.events_applied if path == files[-1] else _records(
                files[files.index(path) + 1])[0].seq)
        assert _verify(path) == 0


def test_a_snapshot_that_does_not_match_its_digest_is_not_trusted(tmp_path: Path) -> None:
    # compress_level 0: the snapshot's state is plain, as encode_record writes it
    recorder = _recorder(tmp_path, max_file_bytes=8_000, compress_level=0)
    world = run_workload(requests=80, seed=5, pool_blocks=64, concurrency=8,
                         sink=paced(recorder))
    recorder.close(world.state)
    second = sorted(tmp_path.glob("*.lolog"))[1]
    records = _records(second)
    from offload_fsm.log.framing import frame
    from tests.logrecords import encode_record

    header, snap = records[0], records[1]
    forged = Snapshot(seq=snap.seq, wall_time_s=snap.wall_time_s, digest="0" * 16,
                      state=snap.state)
    tail = second.read_bytes()[len(frame(encode_record(header, created_s=header.created_s)))
                               + len(frame(encode_record(snap, created_s=header.created_s))):]
    second.write_bytes(frame(encode_record(header, created_s=header.created_s))
                       + frame(encode_record(forged, created_s=header.created_s)) + tail)
    alone = replay(second)
    assert not alone.ok and alone.events_applied == 0
    assert any("rebuilds a state with digest" in line for line in alone.lost)
    whole = replay(tmp_path)  # folding through: the live state differs from the forged digest
    assert whole.divergence is not None and whole.divergence.kind == "digest"


# --------------------------------------------------------------------------
# Retention.


def _total(directory: Path) -> int:
    total = 0
    for path in directory.glob("*.lolog"):
        try:
            total += path.stat().st_size
        except FileNotFoundError:  # deleted by retention meanwhile
            pass
    return total


class _Watch:
    """A sink that records, and samples the directory's total now and then."""

    def __init__(self, recorder: EventRecorder, directory: Path) -> None:
        self.recorder = recorder
        self.record = paced(recorder)
        self.directory = directory
        self.calls = 0
        self.max_total = 0

    def __call__(self, applied: Sequence[tuple[Event, Outcome]], state: State) -> None:
        self.record(applied, state)
        self.calls += 1
        if self.calls % 50 == 0:
            time.sleep(0.002)  # let the writer thread catch up, as real steps do
            self.max_total = max(self.max_total, _total(self.directory))


def test_retention_keeps_the_directory_within_its_bound(tmp_path: Path) -> None:
    max_file, max_total = 12_000, 40_000
    recorder = _recorder(tmp_path, max_file_bytes=max_file, max_total_bytes=max_total)
    watch = _Watch(recorder, tmp_path)
    world = run_workload(requests=400, seed=7, pool_blocks=64, concurrency=8, sink=watch)
    recorder.close(world.state)
    files = sorted(tmp_path.glob("*.lolog"))
    assert len(files) >= 2
    biggest = max(p.stat().st_size for p in files)
    assert watch.max_total <= max_total + 2 * max_file
    assert _total(tmp_path) <= max_total + biggest
    assert files[0].name != "run-000000.lolog"  # the oldest went first
    numbers = [int(p.stem.rsplit("-", 1)[1]) for p in files]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))  # a suffix is left
    for path in files:
        alone = replay(path)
        assert alone.ok, (path.name, alone.lost, alone.damage)
    remaining = replay(tmp_path)
    assert remaining.ok and remaining.ended_cleanly
    assert remaining.first_seq > 0
    assert remaining.first_seq + remaining.events_applied == len(world.applied)


def test_a_second_run_deletes_the_first_runs_oldest_files_first(tmp_path: Path) -> None:
    max_file, max_total = 4_000, 24_000
    first = _recorder(tmp_path, prefix="a", max_file_bytes=max_file, max_total_bytes=10**9)
    world = run_workload(requests=250, seed=3, pool_blocks=64, concurrency=8,
                         sink=paced(first))
    first.close(world.state)
    first_files = sorted(tmp_path.glob("a-*.lolog"))
    assert _total(tmp_path) > max_total
    time.sleep(0.02)  # distinct modification times
    second = _recorder(tmp_path, prefix="b", max_file_bytes=max_file, max_total_bytes=max_total)
    world = run_workload(requests=30, seed=4, pool_blocks=64, concurrency=8,
                         sink=paced(second))
    second.close(world.state)
    left = sorted(tmp_path.glob("a-*.lolog"))
    assert left == first_files[len(first_files) - len(left):]  # oldest deleted, newest kept
    assert len(left) < len(first_files)
    assert sorted(tmp_path.glob("b-*.lolog"))[0].name == "b-000000.lolog"
    assert _total(tmp_path) <= max_total + max_file * 2
    for path in left:
        assert replay(path).ok
    assert main(["verify", str(tmp_path), "--prefix", "b"], out=open(os.devnull, "w")) == 0


def test_retention_never_deletes_the_file_being_written(tmp_path: Path) -> None:
    recorder = _recorder(tmp_path, max_file_bytes=5_000, max_total_bytes=5_000)
    world = run_workload(requests=120, seed=2, pool_blocks=64, concurrency=8,
                         sink=paced(recorder))
    recorder.close(world.state)
    files = sorted(tmp_path.glob("*.lolog"))
    assert len(files) == 1 and replay(files[0]).ok


# --------------------------------------------------------------------------
# A full disk.


class _FlakyDisk:
    """``log_files._open`` whose files raise ENOSPC on write and flush while ``full``."""

    def __init__(self) -> None:
        self.full = False
        self.probes = 0

    def open(self, path: Any, mode: str, buffering: int = -1, opener: Any = None) -> Any:
        if str(path).endswith(".probe"):
            self.probes += 1
        return _FlakyFile(builtins.open(path, mode, buffering=buffering, opener=opener), self)


class _FlakyFile:
    def __init__(self, f: Any, disk: _FlakyDisk) -> None:
        self._f = f
        self._disk = disk

    def _check(self) -> None:
        if self._disk.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def write(self, data: bytes) -> int:
        self._check()
        return int(self._f.write(data))

    def flush(self) -> None:
        self._check()
        self._f.flush()

    def fileno(self) -> int:
        return int(self._f.fileno())

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> _FlakyFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _wait(condition: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


class _Outage:
    """A sink that fills the disk at call ``start`` and frees it at call ``end``."""

    def __init__(self, recorder: EventRecorder, disk: _FlakyDisk, start: int, end: int,
                 hold_s: float) -> None:
        self.recorder, self.disk = recorder, disk
        self.start, self.end, self.hold_s = start, end, hold_s
        self.calls = 0
        self.outage_s = 0.0

    def __call__(self, applied: Sequence[tuple[Event, Outcome]], state: State) -> None:
        self.recorder.record(applied, state)
        self.calls += 1
        writer = self.recorder.writer
        assert writer is not None
        if self.calls == self.start:
            self.disk.full = True
        elif self.calls > self.start and not self.outage_s and \
                type(applied[0][0]) in (StepScheduled, StepsPassed):
            # This callback closed a batch: its write fails and breaks the writer.
            _wait(lambda: writer.broken)
            began = time.monotonic()
            time.sleep(self.hold_s)  # events keep coming, and are lost, while it is full
            self.outage_s = time.monotonic() - began
        elif self.calls == self.end:
            self.disk.full = False
            _wait(lambda: writer.rotation_due)


def test_a_full_disk_costs_events_and_the_log_resumes_when_space_returns(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    disk = _FlakyDisk()
    monkeypatch.setattr(log_files, "_open", disk.open)
    warnings: list[str] = []
    monkeypatch.setattr(eventlog._log, "warning", lambda message, *a: warnings.append(message))
    recorder = _recorder(tmp_path, retry_interval_s=0.05, digest_every=100)
    sink = _Outage(recorder, disk, start=100, end=300, hold_s=0.3)
    world = run_workload(requests=120, seed=5, pool_blocks=64, concurrency=8, sink=sink)
    recorder.close(world.state)
    # The writer probed at most once per retry interval while the disk was full.
    assert 1 <= disk.probes <= sink.outage_s / 0.05 + 3
    assert len([w for w in warnings if "I/O error" in w]) == 1
    assert "ENOSPC" in repr(warnings) or "No space left" in " ".join(warnings)
    (resumed,) = [w for w in warnings if "resumed" in w]
    files = sorted(tmp_path.glob("*.lolog"))
    assert len(files) == 2
    header, gap, snap = _records(files[1])[:3]
    assert (type(header), type(gap), type(snap)) == (Header, Gap, Snapshot)
    assert header.seq == snap.seq
    assert gap.seq + gap.lost_count == snap.seq  # the events lost, counted exactly
    assert gap.lost_count > 0 and f"after {gap.lost_count} lost event(s)" in resumed
    recorded = [e for r in _records(files[0]) if isinstance(r, Inputs) for e in r.events]
    assert len(recorded) <= gap.seq  # a torn tail may hold a few more, never written
    alone = replay(files[1])
    assert alone.ok and alone.ended_cleanly
    assert alone.first_seq + alone.events_applied == len(world.applied)
    whole = replay(tmp_path)  # verified to the outage, the loss reported, verified after
    assert whole.divergence is None and whole.lost
    assert whole.snapshots_loaded == [snap.seq]
    assert whole.events_applied == len(recorded) + len(world.applied) - snap.seq
    assert main(["verify", str(tmp_path)], out=open(os.devnull, "w"),
                err=open(os.devnull, "w")) == 3


def test_a_pending_batch_lost_to_a_full_disk_is_counted_by_its_events(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer keeps a pending batch's payloads and only the event count of
    each item (not the items): when the batch's write fails, every item is
    lost and the gap the log resumes with counts their events exactly."""
    disk = _FlakyDisk()
    monkeypatch.setattr(log_files, "_open", disk.open)
    warnings: list[str] = []
    writer = eventlog.EventLogWriter(
        tmp_path, encoder=PlainEncoder(
            lambda item: repr(item).encode(), lambda: "header", lambda lost: ("gap", lost),
            pack=b"|".join, batchable=lambda item: isinstance(item, tuple),
            item_events=lambda item: item[1] if isinstance(item, tuple) else 1),
        warn=warnings.append, prefix="t", register_atexit=False, flush_interval_s=60.0,
        retry_interval_s=0.01)
    disk.full = True  # the header is in; nothing after it goes out
    for events in (3, 1, 4, 1, 5):
        writer.append(("inputs", events))  # pending in one batch, not yet written
    writer.append("alone")  # not batchable: closes the batch, whose write fails
    _wait(lambda: writer.broken and writer.queue_len == 0)
    _wait(lambda: writer.items_lost == 6)  # the batch's five items, then "alone"
    disk.full = False
    _wait(lambda: writer.rotation_due)
    assert writer.rotate("first")
    _wait(lambda: not writer.broken)
    assert writer.close()
    second = [x.payload for x in scan(writer.files[1].read_bytes())]
    assert second == [b"'header'", b"('gap', 15)", b"'first'"]  # 3+1+4+1+5 events, + "alone"
    assert "after 15 lost event(s)" in warnings[-1]


def test_a_full_disk_that_never_frees_keeps_serving_quietly(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    disk = _FlakyDisk()
    monkeypatch.setattr(log_files, "_open", disk.open)
    warnings: list[str] = []
    monkeypatch.setattr(eventlog._log, "warning", lambda message, *a: warnings.append(message))
    recorder = _recorder(tmp_path, retry_interval_s=0.01)
    disk.full = True
    started = time.monotonic()
    world = run_workload(requests=60, seed=5, pool_blocks=64, concurrency=8,
                         sink=paced(recorder))
    time.sleep(0.1)
    recorder.close(world.state)
    elapsed = time.monotonic() - started
    assert len(warnings) == 1 and "I/O error" in warnings[0], warnings
    assert recorder.snapshots == 0  # no snapshot is taken while the disk stays full
    assert disk.probes <= elapsed / 0.01 + 2
    assert not list(tmp_path.glob(".*.probe"))


def _can_mount_tmpfs(target: Path) -> bool:
    if shutil.which("mount") is None or os.geteuid() != 0:
        return False
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(target)],
                            capture_output=True, timeout=10)
    return result.returncode == 0


def test_a_real_full_tmpfs(tmp_path: Path) -> None:
    mount = tmp_path / "disk"
    mount.mkdir()
    if not _can_mount_tmpfs(mount):
        pytest.skip("cannot mount a tmpfs here (needs root and mount permission); the "
                    "injected-failure tests above cover the same paths")
    recorder: EventRecorder | None = None
    try:
        logs = mount / "logs"
        recorder = _recorder(logs, retry_interval_s=0.05, max_file_bytes=48_000,
                             max_total_bytes=96_000)
        filler = mount / "filler"
        state: dict[str, Any] = {"calls": 0}

        def sink(applied: Sequence[tuple[Event, Outcome]], s: State) -> None:
            assert recorder is not None
            recorder.record(applied, s)
            state["calls"] += 1
            writer = recorder.writer
            assert writer is not None
            if state["calls"] == 200:
                time.sleep(0.05)
                with open(filler, "wb", buffering=0) as f:  # fill the tmpfs to the last byte
                    try:
                        while True:
                            f.write(b"\0" * 4096)
                    except OSError:
                        pass
            elif state["calls"] == 400:
                _wait(lambda: writer.broken)
            elif state["calls"] == 600:
                filler.unlink()
                _wait(lambda: writer.rotation_due)

        world = run_workload(requests=160, seed=6, pool_blocks=64, concurrency=8, sink=sink)
        recorder.close(world.state)
        files = sorted(logs.glob("*.lolog"))
        gaps = [r for p in files for r in _records(p) if isinstance(r, Gap)]
        assert gaps and gaps[0].lost_count > 0
        assert replay(files[-1]).ok
    finally:
        if recorder is not None:
            recorder.close()  # idempotent; no open file may keep the mount busy
        if subprocess.run(["umount", str(mount)], check=False, timeout=10).returncode:
            subprocess.run(["umount", "-l", str(mount)], check=False, timeout=10)


# --------------------------------------------------------------------------
# A log directory that cannot be written at start.


@pytest.fixture(scope="module")
def make_recorder() -> Any:
    from connector.shell.lmcache_connector import _make_handoff

    return _make_handoff


def _unwritable(tmp_path: Path) -> Path:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    return blocker / "logs"  # cannot be created, even by root


def test_a_configured_unwritable_log_dir_fails_start_up_naming_key_path_and_error(
        tmp_path: Path, make_recorder: Any) -> None:
    from offload_fsm.vocabulary.config import ConfigError

    path = _unwritable(tmp_path)
    settings = Settings(shell=ShellConfig(enabled=True, log_dir=str(path)))
    with pytest.raises(ConfigError) as raised:
        make_recorder(settings, 1)
    message = str(raised.value)
    assert raised.value.key == "lmcache.mp.lazy_offload_log_dir"
    assert "lmcache.mp.lazy_offload_log_dir" in message and str(path) in message
    assert "Not a directory" in message or "File exists" in message


def test_the_default_log_dir_unwritable_warns_once_and_serves_without_a_log(
        tmp_path: Path, make_recorder: Any, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    import connector.shell.lmcache_connector as module

    monkeypatch.delenv(module.DEFAULT_LOG_DIR_ENV, raising=False)
    monkeypatch.setattr(module, "DEFAULT_LOG_DIR", str(_unwritable(tmp_path)))
    with caplog.at_level("WARNING", logger="vllm.lazy_offload"):
        assert make_recorder(Settings(shell=ShellConfig(enabled=True)), 1) is None
    (record,) = [r for r in caplog.records if "event log directory" in r.getMessage()]
    assert "serving continues without an event log" in record.getMessage()


def test_a_stale_probe_of_a_reused_pid_does_not_fail_start_up(tmp_path: Path) -> None:
    """A process killed between its probe's create and unlink left
    ``.probe-<pid>``; a new engine with the same pid (a container restarted)
    still finds the directory writable, and leaves nothing of its own."""
    from connector.shell.lmcache_connector import _check_writable

    logs = tmp_path / "logs"
    logs.mkdir()
    stale = logs / f".probe-{os.getpid()}"
    stale.write_bytes(b"")
    _check_writable(str(logs))
    assert [p.name for p in logs.iterdir()] == [stale.name]


def test_a_writable_log_dir_gets_the_configured_bounds(
        tmp_path: Path, make_recorder: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import connector.shell.lmcache_connector as module

    specs: list[dict[str, Any]] = []

    def launcher(spec: dict[str, Any]) -> Any:
        specs.append(spec)

        def launch() -> Any:
            raise OSError("not started in this test")
        return launch

    monkeypatch.setattr(module, "launcher", launcher)
    settings = Settings(shell=ShellConfig(enabled=True, log_dir=str(tmp_path / "logs"),
                                          log_max_total_mib=2.0, log_max_file_mib=0.5,
                                          log_budget_mib=5.0))
    handoff = make_recorder(settings, 1)
    assert handoff is not None and (tmp_path / "logs").is_dir()
    (spec,) = specs
    assert spec["max_file_bytes"] == 512 * 1024
    assert spec["max_total_bytes"] == 2 * 1024 * 1024
    assert spec["budget_bytes"] == 5 * 1024 * 1024
    assert spec["header_config"] == settings.to_wire()

# --------------------------------------------------------------------------
# A directory shared by several processes.

_WRITER = """
import os, sys, time
from connector.recorder.writer import EventLogWriter
from tests.connector.plain_encoder import PlainEncoder
directory, prefix, mode = sys.argv[1], sys.argv[2], sys.argv[3]
w = EventLogWriter(directory, encoder=PlainEncoder(lambda item: item, lambda: b"H" * 64,
                                                  lambda n: b"G"),
                   prefix=prefix, max_file_bytes=16 * 1024,
                   max_total_bytes=64 * 1024, register_atexit=False, flush_interval_s=0.01)
if mode == "idle":  # one file, open, and nothing more
    w.append(b"x" * 1024)
    print("open", w.files[-1], flush=True)
    time.sleep(120)
else:  # busy: rotates through far more than the bound
    for _ in range(2000):
        w.append(b"y" * 1024)
        time.sleep(0.0005)
    w.close()
    print("done", len(w.files), w.stats()["files_deleted"], flush=True)
"""


def _writer_process(directory: Path, prefix: str, mode: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.Popen([sys.executable, "-c", _WRITER, str(directory), prefix, mode],
                            stdout=subprocess.PIPE, text=True, env=env)


def test_a_shared_directory_keeps_its_bound_and_never_deletes_a_live_writers_file(
        tmp_path: Path) -> None:
    """Two writer processes in one directory: a busy one rotating far past
    the bound deletes its own old files but never the idle one's open file;
    once the idle one is killed mid-file, its file is fair game."""
    idle = _writer_process(tmp_path, "idle", "idle")
    try:
        assert idle.stdout is not None
        line = idle.stdout.readline().split()
        assert line[0] == "open"
        idle_file = Path(line[1])
        time.sleep(0.2)  # its first record reaches the file
        busy = _writer_process(tmp_path, "busy", "busy")
        out, _ = busy.communicate(timeout=120)
        assert busy.returncode == 0 and out.startswith("done")
        assert idle_file.exists(), "retention deleted a live writer's open file"
        total = sum(p.stat().st_size for p in tmp_path.glob("*.lolog"))
        assert total <= 64 * 1024 + 2 * 16 * 1024  # the bound, less the files being written
        idle.kill()
        idle.wait(timeout=10)
        again = _writer_process(tmp_path, "busy", "busy")
        again.communicate(timeout=120)
        assert not idle_file.exists(), "a dead writer's file stayed past the bound"
    finally:
        idle.kill()


def test_a_file_that_vanishes_or_may_not_be_deleted_is_skipped_and_the_pass_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import connector.recorder.retention as retention
    import connector.recorder.writer as eventlog

    warnings: list[str] = []
    for n in range(6):
        (tmp_path / f"old-{n:06d}.lolog").write_bytes(b"\0" * 10_000)
        os.utime(tmp_path / f"old-{n:06d}.lolog", (n, n))
    refused = {tmp_path / "old-000000.lolog": PermissionError(13, "not yours"),
               tmp_path / "old-000001.lolog": FileNotFoundError(2, "gone")}
    real = retention.delete_unless_held

    def delete(path: Path) -> bool:
        if path in refused:
            raise refused[path]
        return real(path)

    monkeypatch.setattr(retention, "delete_unless_held", delete)
    w = eventlog.EventLogWriter(tmp_path, encoder=_plain(), warn=warnings.append,
                                prefix="run", max_total_bytes=25_000, register_atexit=False)
    w.close()
    left = sorted(p.name for p in tmp_path.glob("old-*"))
    assert left == ["old-000000.lolog", "old-000001.lolog", "old-000005.lolog"]
    assert len(warnings) == 2  # one per cause, and the pass went on past both


def test_files_another_writer_holds_do_not_starve_the_closed_ones(tmp_path: Path) -> None:
    """A live writer's file larger than the whole bound: it does not count,
    so the closed files keep the bound between them instead of all being
    deleted (the oldest go until the rest fit)."""
    import fcntl

    import connector.recorder.writer as eventlog

    live = tmp_path / "live-000000.lolog"
    live.write_bytes(b"\0" * 40_000)
    for n in range(5):
        (tmp_path / f"old-{n:06d}.lolog").write_bytes(b"\0" * 5_000)
        os.utime(tmp_path / f"old-{n:06d}.lolog", (n, n))
    with live.open("rb") as holder:
        fcntl.flock(holder.fileno(), fcntl.LOCK_EX)  # another writer, alive
        w = eventlog.EventLogWriter(tmp_path, encoder=_plain(), prefix="run",
                                    max_total_bytes=20_000, register_atexit=False)
        w.close()
    left = sorted(p.name for p in tmp_path.glob("old-*"))
    assert left == ["old-000002.lolog", "old-000003.lolog", "old-000004.lolog"]
    assert live.exists()


def test_a_file_that_cannot_be_locked_is_never_deleted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a file system without ``flock`` (some FUSE ones) no writer can hold
    its file, so retention cannot tell a live one: it deletes nothing it
    cannot lock, and the writer says once that its own file is unprotected."""
    import errno
    import fcntl

    import connector.recorder.writer as eventlog

    for n in range(4):
        (tmp_path / f"old-{n:06d}.lolog").write_bytes(b"\0" * 10_000)

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    warnings: list[str] = []
    w = eventlog.EventLogWriter(tmp_path, encoder=_plain(), warn=warnings.append,
                                prefix="run", max_total_bytes=15_000, register_atexit=False)
    w.close()
    assert len(list(tmp_path.glob("old-*"))) == 4
    (said,) = warnings
    assert "not lockable" in said and "No locks available" in said
    assert f"{w.files[0]} may be deleted by another writer's retention" in said
