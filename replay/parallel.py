"""Parallel verify: a run's files (and their later segments) folded on
several processes, and the seams between them checked.

Every file but the first starts with a snapshot, and a schema 4 file may hold
more (``log.records``), so each unit (a file, or one segment of it) replays
alone from its snapshot (file 0 from its header) on a worker process. Then,
at every seam, the next unit's first event must follow the previous unit's
last, and the state the previous unit ended in must have the digest of the
next unit's snapshot. The merged :class:`~replay.runner.ReplayResult` gives
the same verdict as :func:`replay.runner.replay`, without a state.
"""

from __future__ import annotations

import functools
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import attrs

from logfiles.runs import run_files
from logfiles.scan import Entry, frames, read_file
from logfiles.segments import Segment, segments
from offload_fsm.digest import state_digest
from offload_fsm.log.records import Snapshot
from replay import seek
from replay.runner import ReplayResult, replay, spaced_collections

__all__ = ["replay_parallel"]


@attrs.frozen(kw_only=True)
class _FilePart:
    path: str
    result: ReplayResult
    start_digest: str  # the snapshot's digest the file started from ("" for file 0)
    end_seq: int
    end_digest: str


def _replay_file(unit: tuple[str, int, int, str], check_snapshots: bool = False) -> _FilePart:
    """One unit of a parallel verify: a file, or (schema 4) one of its
    segments, from byte ``offset`` (a snapshot) to event ``end_seq``
    (-1: the file's end); ``digest``: that snapshot's."""
    with spaced_collections():
        return _replay_unit(unit, check_snapshots)


def _replay_unit(unit: tuple[str, int, int, str], check_snapshots: bool) -> _FilePart:
    path, offset, end_seq, digest = unit
    if offset == 0 and end_seq < 0:
        result = replay(path, check_snapshots=check_snapshots)
    else:
        segment = Segment(path=Path(path), offset=offset, seq=-1)
        seeked = seek.replay_from([Path(path)], segment, None,
                                  lambda fold: 0 <= end_seq <= fold.next_seq,
                                  check_snapshots=check_snapshots)
        result = seeked if seeked is not None else ReplayResult(
            lost=[f"the snapshot at {path}@{offset} does not restore"])
    state = result.state
    start = ""
    if result.snapshots_loaded and result.snapshots_loaded[0] == result.first_seq:
        start = "snapshot"
    end_digest = state_digest(state) if state is not None and not state.closed else ""
    result.state = None  # states do not travel between processes cheaply
    if offset and start:
        start = digest or start
    return _FilePart(path=path, result=result, start_digest=start,
                     end_seq=result.first_seq + result.events_applied, end_digest=end_digest)


def replay_parallel(path: str | os.PathLike[str], *, prefix: str | None = None,
                    workers: int = 0, check_snapshots: bool = False) -> ReplayResult:
    """:func:`replay`'s verdict on a run, its files replayed on ``workers``
    processes (0: one per core). Each file folds alone from its own snapshot
    (file 0 from its header); then at every seam the next file's first event
    must follow the previous file's last and the state the previous file
    ended in must have the digest of the next file's snapshot. The merged
    result has no state (``state`` is None); use :func:`replay` for analyses."""
    files = _units(path, prefix)
    workers = workers or os.cpu_count() or 1
    one_file = functools.partial(_replay_file, check_snapshots=check_snapshots)
    if workers == 1 or len(files) == 1:
        parts = [one_file(file) for file in files]
    else:
        with ProcessPoolExecutor(max_workers=min(workers, len(files))) as pool:
            parts = list(pool.map(one_file, files))
    merged = ReplayResult()
    for index, part in enumerate(parts):
        result = part.result
        merged.header = merged.header or result.header
        merged.events_applied += result.events_applied
        merged.records += result.records
        merged.digests_checked += result.digests_checked
        merged.snapshots_checked += result.snapshots_checked
        merged.damage.extend(result.damage)
        merged.ended_cleanly = result.ended_cleanly
        merged.vanished = result.vanished
        if index == 0:
            merged.first_seq = result.first_seq
            merged.lost.extend(result.lost)
            if result.snapshots_loaded:
                merged.snapshots_loaded.append(result.first_seq)
        else:
            previous = parts[index - 1]
            merged.lost.extend(lost for lost in result.lost
                               if "earlier files are missing" not in lost)
            seam = _seam(previous, part)
            if seam:
                merged.lost.append(seam)
            merged.snapshots_checked += 1 if not seam else 0
        if merged.divergence is None and result.divergence is not None:
            merged.divergence = result.divergence
        if merged.rejection is None and result.rejection is not None:
            merged.rejection = result.rejection
        if not merged.stopped and result.stopped:
            merged.stopped = f"{part.path}: {result.stopped}"
        if merged.divergence is not None or (merged.rejection is not None
                                             and merged.rejection.reproduced):
            break  # folding ends there for good, as in replay()
    return merged


def _seam(previous: _FilePart, part: _FilePart) -> str:
    result = part.result
    if not result.snapshots_loaded:
        return f"{part.path} has no snapshot to start from: its events were not verified"
    if result.first_seq != previous.end_seq:
        return (f"{part.path} starts at event {result.first_seq}, the file before it "
                f"ends at event {previous.end_seq}")
    snapshot_digest = (part.start_digest if part.start_digest not in ("", "snapshot")
                       else _snapshot_digest(part.path))
    if previous.end_digest and snapshot_digest != previous.end_digest:
        return (f"the state at the end of {previous.path} has digest {previous.end_digest}, "
                f"the snapshot of {part.path} {snapshot_digest}")
    return ""


def _units(path: str | os.PathLike[str], prefix: str | None
           ) -> list[tuple[str, int, int, str]]:
    """What :func:`replay_parallel` farms out: each file from its start, cut
    at its later segments (schema 4 snapshots inside a file), so a run of few
    files still spreads over the workers."""
    by_file: dict[str, list[Segment]] = {}
    for segment in segments(path, prefix):
        by_file.setdefault(str(segment.path), []).append(segment)
    units = []
    for file in map(str, run_files(path, prefix)):
        inside = [s for s in by_file.get(file, []) if s.offset > 0]
        later = inside[1:] if inside and _first_is_next(file, inside[0].offset) else inside
        ends = [s.seq for s in later] + [-1]
        units.append((file, 0, ends[0], ""))
        units += [(file, s.offset, end, s.digest) for s, end in zip(later, ends[1:],
                                                                     strict=True)]
    return units


def _first_is_next(path: str, offset: int) -> bool:
    """Whether the file's first snapshot (at ``offset``) follows its header
    (and a resumed log's GAP): the file's own start, not a later segment."""
    for count, item in enumerate(frames(path)):
        if item.offset == offset:
            return count <= 2
        if count > 2:
            return False
    return False


def _snapshot_digest(path: str) -> str:
    for entry in read_file(path):
        if isinstance(entry, Entry) and type(entry.record) is Snapshot:
            return entry.record.digest
    return ""
