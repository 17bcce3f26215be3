"""``whatif``: re-run a run's recorded observations under another policy or
other knobs, and compare with what happened.

What a counterfactual from a log can and cannot tell
----------------------------------------------------
The observations (arrivals, offered chunks and their blocks, step sizes,
finishes, preemptions, receipts) were recorded under the *original*
decisions. Another policy pins other blocks at other times, and in a real
engine that changes which blocks get reallocated, the free-queue order, the
allocation of the next steps, preemptions and store latency. None of that can
be recovered from the log. So the answers are *synthesised* here:

* block hashes: the snapshot of each offered chunk, changed by the recorded
  reallocations (``StepScheduled.reallocated``) and by blocks offered again;
  a reallocation of a block the counterfactual has pinned is impossible
  there and is skipped (counted as a conflict);
* the danger window: the recorded window (and cascade re-reads) of the
  step, minus blocks the counterfactual pinned, cut to the new depth; blocks
  beyond what was recorded are unknown and padded with placeholders that
  match nothing (counted);
* a lookup's reach (``LookupAnswered``): the recorded walk, minus blocks the
  counterfactual pinned, read again until as many blocks no buffered op of
  the counterfactual covers as the allocation takes, padded with
  placeholders past what was recorded (counted); none under FIFO, nor where
  the reach holds none of the counterfactual's buffered blocks;
* receipts: every store the counterfactual submits completes on all workers
  at the first recorded receipt event at least one step later; a recorded
  failure of a request fails its counterfactual store in flight then.

With ``out`` (``whatif --out DIR``), :func:`simulate` also writes its run
as a log (:class:`LogWriter`: the recorder's record layout, one INPUTS
record per step, a digest on the recorder's spacing, full outcomes), so
``replay diff`` can compare it with the recorded run or with the other
re-run, and every ``replay`` analysis reads it.

To calibrate the estimate, the original settings are re-run through the same
synthetic world: the distance between that and the recorded outcome is a
lower bound on the estimate's error. Treat the what-if as a direction, not
a number.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from logfiles.scan import LogDamage, read_log
from offload_fsm.digest import state_digest
from offload_fsm.log.cursor import LogCursor, run_header
from offload_fsm.log.framing import frame
from offload_fsm.log.names import file_name
from offload_fsm.log.records import (
    Header,
    Inputs,
    encode_digest,
    encode_end,
    encode_header,
    encode_inputs,
)
from offload_fsm.machine import drive
from offload_fsm.queries import watches, window_depth
from offload_fsm.state import State, new_state
from offload_fsm.vocabulary.commands import Command, ReadFreeQueue, ReadHashes, SubmitStore
from offload_fsm.vocabulary.config import (
    PREFIX,
    OffloadConfig,
    Policy,
    Settings,
    parse_recorded_config,
)
from offload_fsm.vocabulary.errors import InvalidEvent, MachinePoisoned
from offload_fsm.vocabulary.events import (
    CandidateOffered,
    Event,
    FreeQueueRead,
    HashesRead,
    LookupAnswered,
    PassedStep,
    PrefixCacheReset,
    ReceiptsArrived,
    ShutdownRequested,
    StepScheduled,
    StepsPassed,
)
from offload_fsm.vocabulary.outcome import Outcome
from replay.summary import SummaryObserver, summarize

CAVEAT = (
    "CAVEAT: a what-if from a log is an estimate. The free-queue windows, "
    "reallocations, step sizes, preemptions and receipt timing were observed under the "
    "original decisions; a different policy would have changed them. Window blocks beyond "
    "what was recorded are unknown, reallocations of blocks the what-if pinned are skipped, "
    "and receipts are synthesised. Compare the what-if with the re-simulated original, "
    "not only with the recorded run."
)


def load_observations(
    path: str | os.PathLike[str], prefix: str | None = None
) -> tuple[Header, list[Event], list[str]]:
    """The header and the recorded events (answers included), up to the first
    damage or lost record; the list of problems that cut it short."""
    header: Header | None = None
    events: list[Event] = []
    problems: list[str] = []
    for entry in read_log(path, prefix):
        if isinstance(entry, LogDamage):
            problems.append(entry.describe())
            break
        record = entry.record
        if isinstance(record, Header) and header is None:
            header = record
        elif isinstance(record, Inputs):
            if record.seq != len(events):
                problems.append(f"events {len(events)}..{record.seq - 1} are missing")
                break
            events.extend(record.events)
    if header is None:
        raise ValueError(f"{path}: no header record")
    return header, events, problems


# The knobs only one policy reads (every other core knob both read).
POLICY_KNOBS: dict[Policy, tuple[str, ...]] = {
    Policy.FIFO: ("threshold", "select_count"),
    Policy.EVICTION_AWARE: ("horizon_steps", "max_drain_per_step", "chunk_split",
                            "cascade_lookahead_blocks"),
}


def override(header: Header, policy: str | None, settings: list[str]) -> OffloadConfig:
    """The header's config with ``--policy`` and ``--set key=value`` applied.
    A knob the resulting policy does not read, or one only the connector
    reads (the event log's, ``lmcache.mp.lazy_offload``), is refused: the
    what-if would silently equal the original."""
    wire = dict(header.config)
    if policy is not None:
        wire[f"{PREFIX}_policy"] = policy
    names = []
    for item in settings:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected key=value")
        key = key.strip()
        full = key if key.startswith(PREFIX) else f"{PREFIX}_{key}"
        wire[full] = value.strip()
        names.append((key, full[len(PREFIX) + 1:]))
    config = parse_recorded_config(wire).offload
    core = {attribute.name for attribute in attrs.fields(OffloadConfig)}
    for key, name in names:
        if name not in core:
            raise ValueError(f"--set {key}: the connector reads it, not the core; a what-if "
                             f"re-runs the core only (its knobs: {', '.join(sorted(core))})")
        other = next((p for p, knobs in POLICY_KNOBS.items()
                      if name in knobs and p is not config.policy), None)
        if other is not None:
            raise ValueError(
                f"--set {key}: {config.policy.value} does not read it (a {other.value} knob; "
                f"{config.policy.value} reads {', '.join(POLICY_KNOBS[config.policy])}); "
                f"add --policy {other.value} to re-run under {other.value}")
    return config


class _SyntheticWorld:
    """Answers the core's commands from what the log knows (see the module docstring)."""

    def __init__(self, state: State) -> None:
        self.state = state
        self.hashes: dict[int, int | None] = {}
        self.window: list[int] = []
        self.extra_window: list[int] = []
        self.submitted: list[tuple[int, str]] = []  # (step submitted, req_id)
        self.step = 0
        self.conflicts = 0
        self.padded_blocks = 0

    def execute(self, command: Command) -> Event | None:
        kind = type(command)
        if kind is ReadHashes:
            assert isinstance(command, ReadHashes)
            return HashesRead(batch_id=command.batch_id,
                              block_hashes=tuple(self.hashes.get(b) for b in command.block_ids))
        if kind is ReadFreeQueue:
            assert isinstance(command, ReadFreeQueue)
            pins = self.state.pins
            seen: dict[int, None] = {}
            for block_id in (*self.window, *self.extra_window):
                if block_id not in pins:
                    seen.setdefault(block_id, None)
            return FreeQueueRead(window_block_ids=tuple(seen)[: command.depth_blocks])
        if kind is SubmitStore:
            assert isinstance(command, SubmitStore)
            self.submitted.append((self.step, command.req_id))
        return None

    def receipts(self, failed: tuple[str, ...], *, all_due: bool) -> ReceiptsArrived | None:
        due = [r for s, r in self.submitted if all_due or s < self.step]
        if not due:
            return None
        self.submitted = [(s, r) for s, r in self.submitted if not (all_due or s < self.step)]
        world_size = self.state.world_size
        return ReceiptsArrived(completed=tuple((r, world_size) for r in dict.fromkeys(due)),
                               failed=tuple(r for r in failed if r in due))

    def step_event(self, recorded: StepScheduled, offered: list[CandidateOffered],
                   extra: list[int]) -> StepScheduled:
        state = self.state
        pins = state.pins
        if not recorded.scheduled_tokens:
            return recorded
        self.step += 1
        for offer in offered:
            for block_id, block_hash in zip(offer.block_ids, offer.block_hashes, strict=True):
                if block_id in pins:
                    self.conflicts += 1
                self.hashes[block_id] = block_hash
        reallocated: dict[int, int | None] = {}
        for offer in offered:
            for block_id, block_hash in zip(offer.block_ids, offer.block_hashes, strict=True):
                if watches(state, block_id):
                    reallocated[block_id] = block_hash
        for block_id, hash_now in recorded.reallocated:
            if block_id in pins:
                self.conflicts += 1
                continue
            self.hashes[block_id] = hash_now
            if watches(state, block_id):
                reallocated[block_id] = hash_now
        depth = window_depth(state, scheduled_tokens=recorded.scheduled_tokens,
                             allocated_blocks=recorded.allocated_blocks,
                             next_step_blocks=recorded.next_step_blocks)
        wanted = min(depth, recorded.free_blocks)
        known: dict[int, None] = {}
        for block_id in (*recorded.window_block_ids, *extra):
            if block_id not in pins:
                known.setdefault(block_id, None)
        window = list(known)[:wanted]
        missing = wanted - len(window)
        if missing > 0:
            self.padded_blocks += missing
            window.extend(-1 - i for i in range(missing))  # unknown blocks: match nothing
        self.window = window
        self.extra_window = []
        return attrs.evolve(recorded, window_block_ids=tuple(window),
                            reallocated=tuple(reallocated.items()))


    def lookup_event(self, recorded: LookupAnswered) -> LookupAnswered | None:
        state = self.state
        owners, pins = state.owners, state.pins
        if state.config.policy is not Policy.EVICTION_AWARE or not owners:
            return None
        window: list[int] = []
        left = recorded.allocation_blocks
        for block_id in recorded.window_block_ids:
            if not left:
                break
            if block_id not in pins:
                window.append(block_id)
                left -= block_id not in owners
        while left and len(window) < recorded.free_blocks:  # unknown blocks: match nothing
            window.append(-1 - len(window))
            left -= 1
            self.padded_blocks += 1
        if not any(block_id in owners for block_id in window):
            return None
        return attrs.evolve(recorded, window_block_ids=tuple(window))


def _scheduled(passed: PassedStep) -> StepScheduled:
    """A passed step as the ``StepScheduled`` it stands for, its window's ids
    unknown (the run read none of the original's buffered blocks)."""
    tokens, allocated, next_blocks, reserve, free, _window, time_s = passed
    return StepScheduled(scheduled_tokens=tokens, allocated_blocks=allocated,
                         next_step_blocks=next_blocks, reserve_blocks=reserve,
                         free_blocks=free, window_block_ids=(), reallocated=(), time_s=time_s)


class LogWriter:
    """A synchronous, single-file log of a re-run, laid out as the connector's
    recorder lays out its first file (replay never imports the connector),
    with the cursor every writer of a log keeps (``offload_fsm.log.cursor``):
    header, one INPUTS record per batch, a DIGEST at a batch boundary where
    one is due, so two logs of the same inputs hold their records at the
    same ``seq``; END with the final digest. Outcomes are written in full."""

    def __init__(self, directory: str | os.PathLike[str], config: OffloadConfig,
                 world_size: int, *, digest_every: int = 1000, prefix: str = "whatif") -> None:
        path = Path(directory)
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        # The owner's alone, as the recorder's logs (a log names requests).
        self._file = open(path / file_name(prefix, 0), "xb",  # noqa: SIM115 (closed in close)
                          opener=lambda name, flags: os.open(name, flags, 0o600))
        self._created_s = time.time()
        self._cursor = LogCursor(digest_every=digest_every)
        self._write(encode_header(run_header(
            seq=0, wall_time_s=self._created_s, config=Settings(offload=config).to_wire(),
            policy=config.policy.value, world_size=world_size,
            versions={"package": "replay whatif", "vllm": "", "lmcache": ""},
            created_s=self._created_s, file_index=0, digest_every=digest_every,
            full_outcomes=True, engine_index=0)))

    def _write(self, payload: bytes) -> None:
        self._file.write(frame(payload))

    def _ms(self) -> int:
        return round((time.time() - self._created_s) * 1000.0)

    def _flush(self) -> None:
        if self._cursor.batch:
            first, batch = self._cursor.take()
            self._write(encode_inputs(first, self._ms(),
                                      (pair for applied in batch for pair in applied),
                                      full_outcomes=True))

    def record(self, applied: Sequence[tuple[Event, Outcome]], state: State) -> None:
        cursor = self._cursor
        if not applied or not cursor.add(applied, applied):
            return
        self._flush()
        if cursor.digest_due(state):
            self._write(encode_digest(cursor.seq - 1, self._ms(), state_digest(state)))

    def close(self, state: State | None) -> None:
        self._flush()
        digest = state_digest(state) if state is not None and not state.closed else ""
        seq = self._cursor.seq
        self._write(encode_end(seq, self._ms(), seq, digest))
        self._file.close()


def simulate(
    config: OffloadConfig, world_size: int, events: list[Event],
    *, out: str | os.PathLike[str] | None = None, digest_every: int = 1000,
    prefix: str = "whatif",
) -> dict[str, Any]:
    """Feed the recorded observations to a fresh core under ``config`` (and,
    with ``out``, write the run as a log there, its files named ``prefix``)."""
    state = new_state(config, world_size=world_size)
    world = _SyntheticWorld(state)
    observer = SummaryObserver()
    writer = (LogWriter(out, config, world_size, digest_every=digest_every, prefix=prefix)
              if out else None)
    seq = 0
    error = ""

    def feed(event: Event) -> None:
        nonlocal seq
        applied = drive(state, event, world.execute)
        for applied_event, outcome in applied:
            observer(seq, applied_event, outcome, state)
            seq += 1
        if writer is not None:
            writer.record(applied, state)

    offered: list[CandidateOffered] = []
    try:
        for index, event in enumerate(events):
            kind = type(event)
            if kind is HashesRead or kind is FreeQueueRead:
                continue  # answers of the original run: synthesised instead
            if kind is CandidateOffered:
                assert isinstance(event, CandidateOffered)
                offered.append(event)
                feed(event)
            elif kind is StepScheduled:
                assert isinstance(event, StepScheduled)
                extra = [b for later in events[index + 1 : index + 8]
                         if type(later) is FreeQueueRead
                         for b in later.window_block_ids]
                world.extra_window = extra
                feed(world.step_event(event, offered, extra))
                offered = []
            elif kind is StepsPassed:
                assert isinstance(event, StepsPassed)
                for passed in event.steps:  # the what-if's windows may hold its ops
                    feed(world.step_event(_scheduled(passed), offered, []))
                    offered = []
            elif kind is LookupAnswered:
                assert isinstance(event, LookupAnswered)
                lookup = world.lookup_event(event)
                if lookup is not None:
                    feed(lookup)
            elif kind is ReceiptsArrived:
                assert isinstance(event, ReceiptsArrived)
                receipts = world.receipts(event.failed, all_due=False)
                if receipts is not None:
                    feed(receipts)
            elif kind is ShutdownRequested:
                receipts = world.receipts((), all_due=True)
                if receipts is not None:
                    feed(receipts)
                feed(event)
            else:
                if kind is PrefixCacheReset:
                    world.hashes.clear()
                feed(event)
    except (InvalidEvent, MachinePoisoned) as failure:
        error = f"the recorded observations became inconsistent at input {seq}: {failure}"
    if writer is not None:
        writer.close(state)
    result = summarize(state, observer)
    result["estimate"] = {"reallocation_conflicts": world.conflicts,
                          "window_blocks_padded": world.padded_blocks, "error": error}
    return result


def compare(recorded: dict[str, Any], original: dict[str, Any], whatif: dict[str, Any]
            ) -> list[tuple[str, Any, Any, Any]]:
    rows: list[tuple[str, Any, Any, Any]] = []

    def row(name: str, get: Any) -> None:
        rows.append((name, get(recorded), get(original), get(whatif)))

    row("stored ops", lambda s: s["stored"]["ops"])
    row("stored tokens", lambda s: s["stored"]["tokens"])
    for cause in recorded["dropped_by_cause"]:
        if any(s["dropped_by_cause"][cause]["ops"] for s in (recorded, original, whatif)):
            row(f"dropped {cause} ops", lambda s, c=cause: s["dropped_by_cause"][c]["ops"])
    row("drop rate (ops)", lambda s: f"{s['drop_rate']['ops']:.2%}")
    row("drop rate (tokens)", lambda s: f"{s['drop_rate']['tokens']:.2%}")
    row("deferral mean (steps)", lambda s: f"{s['deferral_steps']['mean']:.2f}")
    row("deferral p50 (steps)", lambda s: s["deferral_steps"]["p50"])
    row("deferral p99 (steps)", lambda s: s["deferral_steps"]["p99"])
    row("peak pinned blocks", lambda s: s["peak_pinned_blocks"])
    return rows


def format_rows(rows: list[tuple[str, Any, Any, Any]], original: str, whatif: str) -> str:
    head = ("metric", "recorded", f"re-sim {original}", f"what-if {whatif}")
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(4)]
    lines = ["  ".join(str(v).ljust(w) if i == 0 else str(v).rjust(w)
                       for i, (v, w) in enumerate(zip(r, widths, strict=True)))
             for r in [head, *rows]]
    return "\n".join(lines)


def describe(config: OffloadConfig) -> str:
    return f"{config.policy.value} {config.describe()}"

