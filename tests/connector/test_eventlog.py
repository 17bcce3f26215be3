from __future__ import annotations

import gc
import json
import os
import threading
import time
import weakref
from collections import deque
from pathlib import Path
from typing import Any

import pytest

from connector.recorder.writer import EventLogWriter
from logfiles.runs import run_files
from offload_fsm.log.framing import Damage, Record, frame, scan, scan_stream
from tests.connector.plain_encoder import PlainEncoder

HEADER = {"kind": "header", "schema": 1}


def _encode(item: object) -> bytes:
    return json.dumps(item, sort_keys=True).encode()


def _make_gap(n: int) -> object:
    return {"kind": "gap", "lost": n}


class Warnings:
    def __init__(self) -> None:
        self.messages: list[str] = []
        self._lock = threading.Lock()

    def __call__(self, message: str) -> None:
        with self._lock:
            self.messages.append(message)


def _writer(tmp_path: Path, warn: Warnings | None = None, **kw: Any) -> EventLogWriter:
    encoder = PlainEncoder(kw.pop("encode", _encode), lambda: HEADER, _make_gap,
                           **{key: kw.pop(key) for key in ("pack", "batchable", "item_events",
                                                           "item_bytes") if key in kw})
    return EventLogWriter(
        tmp_path,
        encoder=encoder,
        warn=warn if warn is not None else Warnings(),
        prefix=kw.pop("prefix", "test"),  # type: ignore[arg-type]
        register_atexit=False,
        **kw,  # type: ignore[arg-type]
    )


def _read(path: Path) -> list[object]:
    items = list(scan(path.read_bytes()))
    assert all(isinstance(x, Record) for x in items), items
    return [json.loads(x.payload) for x in items if isinstance(x, Record)]


def test_items_written_in_order_and_readable(tmp_path: Path) -> None:
    w = _writer(tmp_path)
    for i in range(1000):
        w.append({"i": i})
    assert w.close()
    assert w.files == (tmp_path / "test-000000.lolog",)
    payloads = _read(w.files[0])
    assert payloads[0] == HEADER
    assert payloads[1:] == [{"i": i} for i in range(1000)]
    assert w.items_written == 1000
    assert w.items_lost == 0
    assert w.bytes_written == w.files[0].stat().st_size
    assert w.stats()["files"] == 1
    with w.files[0].open("rb") as stream:
        assert list(scan_stream(stream, chunk_bytes=5)) == list(scan(w.files[0].read_bytes()))


def test_periodic_flush_without_close(tmp_path: Path) -> None:
    w = _writer(tmp_path, flush_interval_s=0.01)
    w.append({"i": 1})
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if len(_read(w.files[0])) == 2:
                break
            time.sleep(0.01)
        assert _read(w.files[0]) == [HEADER, {"i": 1}]
    finally:
        w.close()


def test_rotation_each_file_starts_with_header(tmp_path: Path) -> None:
    rec_size = len(frame(_encode({"i": 100, "pad": "x" * 50})))
    w = _writer(tmp_path, max_file_bytes=rec_size * 10)
    for i in range(100, 200):
        w.append({"i": i, "pad": "x" * 50})
    assert w.close()
    files = w.files
    assert len(files) > 3
    assert [p.name for p in files] == [f"test-{n:06d}.lolog" for n in range(len(files))]
    assert run_files(tmp_path) == list(files)
    seen = []
    for path in files:
        payloads = _read(path)
        assert payloads[0] == HEADER
        assert HEADER not in payloads[1:]
        assert path.stat().st_size <= rec_size * 10
        seen.extend(payloads[1:])
    assert seen == [{"i": i, "pad": "x" * 50} for i in range(100, 200)]
    assert w.items_written == 100
    assert w.bytes_written == sum(p.stat().st_size for p in files)


class BlockingEncoder:
    """Encoder that blocks on items carrying ``"block": True`` until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, item: object) -> bytes:
        if isinstance(item, dict) and item.get("block"):
            self.entered.set()
            assert self.release.wait(10)
        return _encode(item)

    def hold_writer(self, w: EventLogWriter, item: dict[str, object]) -> None:
        """Append ``item`` and wait until the writer thread is stuck encoding it."""
        _wait_empty(w)
        self.entered.clear()
        self.release.clear()
        w.append({**item, "block": True})
        assert self.entered.wait(10)
        assert w.queue_len == 0

    def drain(self, w: EventLogWriter) -> None:
        self.release.set()
        _wait_empty(w)


def _wait_empty(w: EventLogWriter) -> None:
    deadline = time.monotonic() + 10
    while w.queue_len and time.monotonic() < deadline:
        time.sleep(0.001)
    assert w.queue_len == 0


def test_close_is_idempotent_and_flushes(tmp_path: Path) -> None:
    warns = Warnings()
    w = _writer(tmp_path, warns, flush_interval_s=3600, flush_bytes=1 << 30)
    for i in range(500):
        w.append({"i": i})
    assert w.close()
    size = w.files[0].stat().st_size
    assert len(_read(w.files[0])) == 501
    assert w.close()
    assert w.close(timeout_s=0)
    assert w.files[0].stat().st_size == size
    # Appending after close is counted and warned, never silent, never written.
    w.append({"i": "late"})
    assert w.items_lost == 1
    assert len(warns.messages) == 1
    assert w.files[0].stat().st_size == size


def test_context_manager(tmp_path: Path) -> None:
    with _writer(tmp_path) as w:
        w.append({"i": 1})
    assert _read(w.files[0]) == [HEADER, {"i": 1}]


def test_encode_failure_becomes_gap_and_warns_once(tmp_path: Path) -> None:
    warns = Warnings()
    w = _writer(tmp_path, warns)
    w.append({"i": 0})
    w.append(object())  # not JSON-serialisable
    w.append(object())
    w.append({"i": 1})
    assert w.close()
    assert _read(w.files[0]) == [
        HEADER,
        {"i": 0},
        {"kind": "gap", "lost": 1},
        {"kind": "gap", "lost": 1},
        {"i": 1},
    ]
    assert w.items_lost == 2
    assert w.encode_errors == 2
    assert len(warns.messages) == 1


def test_torn_tail_after_crash_is_reported_and_skipped(tmp_path: Path) -> None:
    w = _writer(tmp_path)
    for i in range(10):
        w.append({"i": i})
    assert w.close()
    path = w.files[0]
    data = path.read_bytes()
    path.write_bytes(data[:-3])  # simulate a crash in the middle of the last write
    items = list(scan(path.read_bytes()))
    records = [x for x in items if isinstance(x, Record)]
    damages = [x for x in items if isinstance(x, Damage)]
    assert [json.loads(r.payload) for r in records] == [HEADER, *[{"i": i} for i in range(9)]]
    assert len(damages) == 1 and damages[0].is_torn_tail


def test_default_prefix_and_no_clobber(tmp_path: Path) -> None:
    w = EventLogWriter(tmp_path, encoder=PlainEncoder(_encode, lambda: HEADER, _make_gap),
                       register_atexit=False)
    w.close()
    name = w.files[0].name
    assert name.endswith("-000000.lolog")
    assert str(os.getpid()) in name
    before = w.files[0].read_bytes()
    again = _writer(tmp_path, prefix=w.prefix)  # never clobbers: it goes on after
    again.close()
    assert again.files[0].name.endswith("-000001.lolog")
    assert w.files[0].read_bytes() == before


def test_atexit_flushes_on_interpreter_exit(tmp_path: Path) -> None:
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    code = (
        "import json, sys\n"
        "from connector.recorder.writer import EventLogWriter\n"
        "from tests.connector.plain_encoder import PlainEncoder\n"
        "w = EventLogWriter(sys.argv[1], encoder=PlainEncoder(\n"
        "    lambda o: json.dumps(o).encode(), lambda: 'H', lambda n: ['gap', n]), prefix='x',\n"
        "    flush_interval_s=3600, flush_bytes=1 << 30)\n"
        "for i in range(2000):\n"
        "    w.append(i)\n"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, cwd=root, timeout=60)
    assert _read(tmp_path / "x-000000.lolog") == ["H", *range(2000)]


def _pack(payloads: list[bytes]) -> bytes:
    return json.dumps({"batch": [json.loads(p) for p in payloads]}).encode()


def test_batchable_items_go_out_as_one_record_per_flush(tmp_path: Path) -> None:
    w = _writer(tmp_path, pack=_pack, batchable=lambda item: "i" in item,  # type: ignore[operator]
                flush_interval_s=60.0)
    for i in range(10):
        w.append({"i": i})
    w.append({"alone": 1})  # not batchable: closes the batch, written on its own
    for i in range(10, 15):
        w.append({"i": i})
    assert w.close()
    records = _read(w.files[0])
    assert records[0] == HEADER
    assert records[1:] == [{"batch": [{"i": i} for i in range(10)]}, {"alone": 1},
                           {"batch": [{"i": i} for i in range(10, 15)]}]
    assert w.items_written == 16 and w.records_written == 4


class _Item:
    """A caller item a weak reference can follow."""

    def __init__(self, i: int) -> None:
        self.i = i


def test_a_pending_batch_keeps_its_payloads_not_its_items(tmp_path: Path) -> None:
    """The writer keeps a pending batch's payloads, never the caller's items:
    items kept alive for a flush interval would bring the cyclic GC's young
    collections due on the heap vLLM's scheduler thread shares."""
    w = _writer(tmp_path, pack=_pack, batchable=lambda item: isinstance(item, _Item),
                encode=lambda item: _encode({"i": item.i} if isinstance(item, _Item) else item),
                item_events=lambda item: 2, flush_interval_s=60.0)
    items = [_Item(i) for i in range(5)]
    alive = [weakref.ref(item) for item in items]
    for item in items:
        w.append(item)
    deadline = time.monotonic() + 10
    while w.queue_len and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.05)  # the writer is done with the last one it took
    del items, item
    gc.collect()
    # None kept while the batch is pending (the writer's loop may still hold
    # the last one it took, until it takes the next).
    assert [ref() for ref in alive[:-1]] == [None] * 4
    assert w.records_written == 1  # the header only: the batch is still pending
    assert w.close()
    assert _read(w.files[0])[1:] == [{"batch": [{"i": i} for i in range(5)]}]
    assert w.items_written == 5


def test_a_batch_closes_at_batch_bytes(tmp_path: Path) -> None:
    w = _writer(tmp_path, pack=_pack, batchable=lambda item: True, batch_bytes=100,
                flush_interval_s=60.0)
    for i in range(100):
        w.append({"i": i})
    assert w.close()
    batches = [r["batch"] for r in _read(w.files[0])[1:]]  # type: ignore[index]
    assert [x["i"] for batch in batches for x in batch] == list(range(100))
    assert len(batches) > 5 and all(len(json.dumps(b)) < 200 for b in batches)


def test_items_queued_just_before_close_are_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The writer found the queue empty; before it looked at the closing flag,
    the producer queued its last items and called close(). Those items were
    queued before close(), so they reach the file (they were dropped as
    "appended during close()": the cause of a rare recorded log without its
    END). The interleaving is forced at that very point."""
    import connector.recorder.writer as eventlog_module

    writers: list[EventLogWriter] = []

    class RacyDeque(deque):  # type: ignore[type-arg]
        armed = False

        def popleft(self) -> object:
            try:
                return super().popleft()
            except IndexError:
                if RacyDeque.armed:  # the producer runs here: last items, then close()
                    RacyDeque.armed = False
                    self.append({"last": 1})
                    self.append({"last": 2})
                    writers[0]._closing = True
                raise

    monkeypatch.setattr(eventlog_module, "deque", RacyDeque)
    warn = Warnings()
    w = _writer(tmp_path, warn)
    writers.append(w)
    w.append({"i": 0})
    deadline = time.monotonic() + 5.0
    while w.items_written < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    RacyDeque.armed = True
    w._wake.set()
    assert w.close()
    assert _read(w.files[0])[1:] == [{"i": 0}, {"last": 1}, {"last": 2}]
    assert not any("during close" in m for m in warn.messages), warn.messages


def _weight(item: object) -> int:
    return int(item.get("bytes", 0)) if isinstance(item, dict) else 0


def test_the_queue_never_drops_and_says_when_it_is_half_full(tmp_path: Path) -> None:
    """The bound is the caller's (the recorder process takes nothing more in
    while ``busy``): the writer keeps every item it is given."""
    warns = Warnings()
    enc = BlockingEncoder()
    w = _writer(tmp_path, warns, encode=enc, item_bytes=_weight, queue_max_bytes=1000)
    enc.hold_writer(w, {"i": -1})
    for i in range(4):
        w.append({"i": i, "bytes": 100})
    assert not w.busy
    w.append({"i": 4, "bytes": 100})
    assert w.busy and w.queued_bytes == 500
    for i in range(5, 20):  # past the bound: kept, the caller was told
        w.append({"i": i, "bytes": 100})
    enc.drain(w)
    assert not w.busy
    assert w.close()
    assert w.items_lost == 0 and w.items_written == 21 and not warns.messages

class _HangingFile:
    """A file whose writes hang until released (a hung mount)."""

    def __init__(self, real: object, release: threading.Event, entered: threading.Event,
                 hang_after: int) -> None:
        self._real = real
        self._release = release
        self._entered = entered
        self._writes = 0
        self._hang_after = hang_after

    def write(self, data: bytes) -> int:
        self._writes += 1
        if self._writes > self._hang_after:
            self._entered.set()
            assert self._release.wait(10)
        return self._real.write(data)  # type: ignore[attr-defined, no-any-return]

    def __getattr__(self, name: str) -> object:
        return getattr(self._real, name)


def test_a_write_that_hangs_sends_the_writer_to_broken_mode(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that has not returned after ``io_stall_s``: the producer's
    next append turns the writer broken (one warning), and what comes is
    dropped and counted instead of queued behind the hung write."""
    import connector.recorder.files as files

    release, entered = threading.Event(), threading.Event()
    real_open = files._open
    monkeypatch.setattr(files, "_open", lambda *a, **k: _HangingFile(
        real_open(*a, **k), release, entered, hang_after=1))  # the header goes through
    warns = Warnings()
    w = _writer(tmp_path, warns, io_stall_s=0.2, flush_bytes=1, item_bytes=_weight)
    try:
        w.append({"i": 0})
        assert entered.wait(10)
        w.append({"i": 1})  # sees the write in flight
        assert not w.broken
        time.sleep(0.3)
        w.append({"i": 2})
        assert w.broken
        assert any("has not returned for 0.2 s" in m for m in warns.messages), warns.messages
    finally:
        release.set()
        w.close()
    assert w.items_lost >= 1


def test_a_process_stopped_mid_write_is_not_a_hung_disk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole process stopped mid-write (SIGSTOP, a frozen cgroup) and
    resumed: the write began long ago, but the producer has only now seen
    it in flight; once it returns, nothing is dropped and the log ends as
    it should."""
    import connector.recorder.files as files

    release, entered = threading.Event(), threading.Event()
    real_open = files._open
    monkeypatch.setattr(files, "_open", lambda *a, **k: _HangingFile(
        real_open(*a, **k), release, entered, hang_after=1))
    warns = Warnings()
    w = _writer(tmp_path, warns, io_stall_s=0.2, flush_bytes=1, item_bytes=_weight)
    try:
        w.append({"i": 0})
        assert entered.wait(10)
        w._disk.io_since -= 100.0  # as if stopped for 100 s since the write began
        w.append({"i": 1})
        assert not w.broken
        release.set()
        while w._disk.io_since:
            time.sleep(0.01)
        w.append({"i": 2})
        assert not w.broken
    finally:
        release.set()
        assert w.close()
    assert w.items_lost == 0 and not warns.messages
    assert _read(w.files[0]) == [HEADER, {"i": 0}, {"i": 1}, {"i": 2}]


def test_a_writer_that_takes_over_a_prefix_goes_on_after_its_files(tmp_path: Path) -> None:
    first = _writer(tmp_path, prefix="run")
    first.append({"i": 0})
    assert first.close()
    second = _writer(tmp_path, prefix="run")
    second.append({"i": 1})
    assert second.close()
    assert [p.name for p in run_files(tmp_path)] == ["run-000000.lolog", "run-000001.lolog"]


def test_logs_are_the_owners_alone(tmp_path: Path) -> None:
    """A new directory is 0700 and each file 0600; an existing directory
    open to others is left as it is (shared on purpose: its group's access,
    its setgid bit), with one warning; a stricter one is kept as it is."""
    import stat

    fresh = tmp_path / "fresh" / "logs"
    w = _writer(fresh)
    w.append({"i": 0})
    assert w.close()
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o700
    assert stat.S_IMODE(w.files[0].stat().st_mode) == 0o600
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o2770)
    warnings = Warnings()
    w = _writer(shared, warnings)
    w.append({"i": 0})
    assert w.close()
    assert stat.S_IMODE(shared.stat().st_mode) == 0o2770
    assert stat.S_IMODE(w.files[0].stat().st_mode) == 0o600
    (said,) = warnings.messages
    assert f"{shared} is open to others (mode 2770); it is left as it is" in said
    strict = tmp_path / "strict"
    strict.mkdir()
    strict.chmod(0o300)  # stricter than 0700 (the owner may not list it): kept
    try:
        _writer(strict).close()
        assert stat.S_IMODE(strict.stat().st_mode) == 0o300
    finally:
        strict.chmod(0o700)


def test_the_disk_probe_never_follows_a_planted_link(tmp_path: Path) -> None:
    """During a disk outage the writer probes with a scratch file; a symlink
    planted under its name (in a shared directory) is removed, not written
    through."""
    target = tmp_path / "victim"
    target.write_bytes(b"keep me")
    logs = tmp_path / "logs"
    w = _writer(logs, probe_bytes=16)
    try:
        (logs / f".{w.prefix}.probe").symlink_to(target)
        w._probe()
    finally:
        w.close()
    assert target.read_bytes() == b"keep me"
    assert not (logs / f".{w.prefix}.probe").exists()


def test_a_link_planted_between_the_unlink_and_the_open_is_not_written_through(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The race the unlink alone leaves open: another user plants the link
    after it. The exclusive create refuses the existing name; the probe fails
    (the writer stays broken and probes again later) and the target is intact."""
    import connector.recorder.files as files

    target = tmp_path / "victim"
    target.write_bytes(b"keep me")
    logs = tmp_path / "logs"
    w = _writer(logs, probe_bytes=16)
    probe = logs / f".{w.prefix}.probe"
    real_open = files._open

    def planting_open(path: Any, *args: Any, **kwargs: Any) -> Any:
        if Path(path) == probe:
            probe.symlink_to(target)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(files, "_open", planting_open)
    try:
        w._probe()
    finally:
        monkeypatch.setattr(files, "_open", real_open)
        w.close()
    assert target.read_bytes() == b"keep me"
