"""Replay is bounded by construction: each crafted log of a few KB
(``tests.replay.hostile_logs``), which without its bound expands into GBs,
burns CPU or is misread, ends in exit 3 with a message naming the field,
the value and the bound (``offload_fsm.log.bounds``); and replay's own
memory ceiling (``replay.memory``) turns what no bound foresaw into a clear
error.

Each hostile log runs ``python -m replay`` in a subprocess under a 1 GiB
address-space limit, so a reader without the bound fails the test (out of
that memory, or with another verdict) instead of taking the machine."""

from __future__ import annotations

import io
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from offload_fsm.log import compact, runs, snapshot_pack
from offload_fsm.log.bounds import MAX_BATCH_OBJECTS, MAX_POOL_BLOCKS
from offload_fsm.log.compact import WireContext
from offload_fsm.vocabulary.errors import LogCorrupt
from replay import memory
from replay.cli import main
from tests.replay import hostile_logs
from tests.replay.conftest import record_rotated

ROOT = Path(__file__).resolve().parents[2]
_AS_LIMIT_BYTES = 1 << 30


def _limit_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (_AS_LIMIT_BYTES, _AS_LIMIT_BYTES))


def _replay(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "replay", *args], cwd=ROOT, text=True,
                          capture_output=True, timeout=120, preexec_fn=_limit_address_space,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


@pytest.mark.parametrize(("kind", "message"), [
    ("window-copies", "FreeQueueRead.window_block_ids: its copies make 800000000 block ids, "
                      f"more than a list of block ids holds (at most {MAX_POOL_BLOCKS})"),
    ("window-repeats", "FreeQueueRead.window_block_ids: its copies make 4000001 block ids, "
                       "past what one record batch may expand to"),
    ("list-runs", "CandidateOffered.block_ids: its copies make 2000000000 block ids"),
    ("run-lookups", "CandidateOffered.block_ids: finding its runs' first ids takes 799999 "
                    "more steps, past what one record batch may expand to"),
    ("msgpack-objects", f"a batch decodes to more than {MAX_BATCH_OBJECTS} msgpack objects"),
    ("batch-stream-end", "batch ends its segment's zlib stream, with 6 bytes after the end"),
    ("snapshot-unused-data", "SNAPSHOT state: 33 bytes after its zlib stream"),
    ("snapshot-bomb", "SNAPSHOT state inflates past 1048576 bytes"),
    ("snapshot-empty-records", "snapshot: a Batch record has 0 values, expected 9 (checked "
                               "before its table is built)"),
])
def test_a_crafted_log_ends_in_damage_naming_its_bound(tmp_path: Path, kind: str,
                                                       message: str) -> None:
    data = hostile_logs.KINDS[kind]()
    assert len(data) < 40_000  # a few KB (the snapshot ones carry a real snapshot)
    path = tmp_path / f"{kind}.lolog"
    path.write_bytes(data)
    done = _replay("verify", str(path))
    assert "Traceback" not in done.stderr, done.stderr
    assert message in done.stderr, done.stderr
    assert done.returncode == 3, done.stderr


def test_the_segment_tables_are_bounded_by_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hashes and lists a segment remembers per block id: more distinct
    ids than a pool holds is damage (a small ceiling here, to keep it fast)."""
    monkeypatch.setattr(compact, "MAX_POOL_BLOCKS", 100)
    monkeypatch.setattr(runs, "MAX_POOL_BLOCKS", 100)
    step = (3, 1, 0, 0, 0, 0, (), tuple((block_id, block_id + 1000) for block_id in range(101)),
            0.0)
    with pytest.raises(LogCorrupt, match=r"hashes of 101 block ids, more than a block pool "
                                         r"holds \(at most 100\)"):
        WireContext().expand(step)
    context = WireContext()
    for first in (0, 60):
        offered = (2, "r", 0, 16, tuple(range(first, first + 60)), (None,) * 60, 0.0, 0)
        if first == 0:
            context.expand(offered)
            continue
        with pytest.raises(LogCorrupt, match=r"the lists before name 120 block ids, more "
                                             r"than a block pool holds \(at most 100\)"):
            context.expand(offered)


def test_a_snapshots_stored_keys_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A snapshot's keys kept from the one before plus its own: at most what a
    state holds, checked before they are joined."""
    monkeypatch.setattr(snapshot_pack, "STORED_KEYS_MAX", 10)
    wire = _tiny_snapshot_wire()
    at = snapshot_pack._keys_at(wire)
    body = list(wire[2])
    body[at] = {"front": 0, "tail": tuple(range(4))}
    delta = (*wire[:2], tuple(body), *wire[3:])
    with pytest.raises(LogCorrupt, match=r"7 kept and 4 added, more than a state holds "
                                         r"\(at most 10\)"):
        snapshot_pack.expand_snapshot(delta, tuple(range(100, 107)))


def _tiny_snapshot_wire() -> tuple[object, ...]:
    from offload_fsm.log import snapshot
    from offload_fsm.state import new_state
    from offload_fsm.vocabulary.config import OffloadConfig

    return snapshot.take(new_state(OffloadConfig(), world_size=1))


def test_reaching_the_memory_ceiling_is_a_message_and_exit_3(tmp_path: Path) -> None:
    golden = str(hostile_logs.GOLDEN)
    for args, env in ((["--max-memory-mib", "8", "verify", golden], {}),
                      (["verify", golden], {memory.ENV_VAR: "8"})):
        done = _replay(*args, env=env)
        assert "Traceback" not in done.stderr, done.stderr
        assert "error: out of memory under replay's ceiling of 8 MiB" in done.stderr
        assert done.returncode == 3


def test_the_default_ceiling_leaves_forked_workers_verifying(tmp_path: Path) -> None:
    directory = record_rotated(tmp_path / "rot", requests=60)
    done = _replay("verify", str(directory), "--workers", "2")
    assert done.returncode == 0, done.stderr
    assert "OK: every outcome and digest matches" in done.stdout


def test_a_worker_out_of_memory_is_the_same_message(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A forked worker's MemoryError travels back to the command line."""
    from replay import parallel

    directory = record_rotated(tmp_path / "rot", requests=60)

    def out_of_memory(unit: object, check_snapshots: bool) -> None:
        raise MemoryError

    monkeypatch.setattr(parallel, "_replay_unit", out_of_memory)
    err = io.StringIO()
    code = main(["--max-memory-mib", "4096", "verify", str(directory), "--workers", "2"],
                out=io.StringIO(), err=err)
    assert code == 3
    assert "error: out of memory under replay's ceiling of 4096 MiB" in err.getvalue()


def test_the_ceiling_is_lifted_when_the_command_returns() -> None:
    before = resource.getrlimit(resource.RLIMIT_DATA)
    code = main(["--max-memory-mib", "4096", "verify", str(hostile_logs.GOLDEN)],
                out=io.StringIO(), err=io.StringIO())
    assert code == 0
    assert resource.getrlimit(resource.RLIMIT_DATA) == before


def test_the_default_ceiling_is_half_a_containers_limit(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a container's memory limit the OOM killer answers that limit, not
    the machine's memory: the default takes the lower."""
    limit = tmp_path / "memory.max"
    limit.write_text(f"{512 << 20}\n")
    monkeypatch.setattr(memory, "CGROUP_LIMIT_FILES", (str(tmp_path / "absent"), str(limit)))
    assert memory.default_mib() == 256
    limit.write_text("max\n")  # no limit (cgroup v2)
    assert memory.default_mib() == min(memory.DEFAULT_MAX_MIB, os.sysconf("SC_PHYS_PAGES")
                                       * os.sysconf("SC_PAGE_SIZE") // 2 >> 20)


def test_a_bad_ceiling_is_a_usage_error() -> None:
    err = io.StringIO()
    assert main(["--max-memory-mib", "-1", "verify", "x"], err=err) == 2
    with pytest.raises(ValueError, match="LAZY_OFFLOAD_REPLAY_MAX_MEMORY_MIB='lots' is invalid"):
        memory.parse_mib("lots", memory.ENV_VAR)
