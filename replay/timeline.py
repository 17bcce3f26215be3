"""``timeline``: a run at a glance, on one x axis of token steps.

:func:`build_timeline` replays a log and returns a :class:`Timeline`:

* per token step (a ``StepScheduled`` that scheduled tokens, or a run of
  them passed in one ``StepsPassed``, sampled after
  the step's answers): the free pool (vLLM's free-queue length after the
  step's allocation), the danger depth (EVICTION_AWARE's window; 0 under
  FIFO), pinned blocks, buffered ops, and the ops submitted and dropped
  since the previous step's sample (the drops also per cause); and the
  recorder's wall clock in seconds since the first event (the INPUTS record
  that carried the step);
* markers: the token steps of prefix-cache resets and of the shutdown (at
  most :data:`MAX_MARKERS`, the rest counted);
* per-request lanes: every store op of the chosen requests
  (:class:`~replay.opstory.OpStory`, from :class:`~replay.opstory.OpTracker`)
  from the step it was offered to the step it was stored, failed, abandoned,
  rejected or dropped (with the cause), or still open at the end of the log.

Bounded: the series hold at most :data:`MAX_POINTS` points; past that,
neighbouring points merge and the width in steps doubles (levels keep the
worst value of the merged steps, the free pool its minimum, the others
their maximum; per-step counts add up). Lanes: the requests named in
``requests``, else the ``max_lanes`` requests that offered the most ops
(ties: the first to offer), found by a first replay that counts offers per
request, shown in the order they first offered; a second replay then
follows only those. At most :data:`MAX_OPS_PER_LANE` ops per lane are kept
(the first offered); the rest are counted. Memory: the points, the lanes'
ops, and one count per request. The picture is :mod:`replay.timeline_plot`.
"""

from __future__ import annotations

import bisect
from collections import Counter as Tally
from collections.abc import Sequence
from typing import Any

import attrs

from offload_fsm.state import State
from offload_fsm.vocabulary.counters import DROPPED_OPS, Counter
from offload_fsm.vocabulary.decisions import DropCause
from offload_fsm.vocabulary.events import (
    CandidateOffered,
    Event,
    FreeQueueRead,
    HashesRead,
    PrefixCacheReset,
    RequestPreempted,
    ShutdownBegan,
    ShutdownRequested,
    StepScheduled,
    StepsPassed,
)
from offload_fsm.vocabulary.outcome import Outcome
from replay.opstory import OpStory, OpTracker
from replay.runner import ReplayResult, replay

MAX_POINTS = 2000
MAX_OPS_PER_LANE = 200
MAX_LANES = 200  # the most lanes one picture may ask for

MAX_MARKERS = 100  # resets and shutdowns marked; the rest are counted


def dropped_key(cause: DropCause) -> str:
    """The series of ops dropped for ``cause`` per step."""
    return f"dropped_{cause.value}_ops"


# Series: key -> how merged points combine (levels keep the worst, counts add up).
SERIES: dict[str, Any] = {
    "free_blocks": min, "depth_blocks": max, "pinned_blocks": max, "buffered_ops": max,
    "submitted_ops": int.__add__, "dropped_ops": int.__add__,
    **{dropped_key(cause): int.__add__ for cause in DropCause},
}
_DROPPED = tuple(DROPPED_OPS.values())
# What a marker on the x axis stands for.
MARKED: dict[type[Event], str] = {PrefixCacheReset: "prefix-cache reset",
                                  ShutdownBegan: "shutdown began",
                                  ShutdownRequested: "shutdown"}


@attrs.define(kw_only=True)
class Lane:
    req_id: str
    offered_ops: int
    ops: list[OpStory]
    left_out_ops: int = 0


@attrs.define(kw_only=True)
class Timeline:
    steps: list[int]  # the first token step of each point
    seconds: list[float]  # seconds since the first event, at that step
    width_steps: int  # token steps per point (1 until the series were merged)
    series: dict[str, list[int]]
    last_step: int
    token_steps: int  # token steps sampled (the steps replayed)
    lanes: list[Lane]
    requests_with_ops: int  # requests that offered at least one op
    chosen_by: str  # "busiest" or "requests"
    markers: list[tuple[int, str]] = attrs.Factory(list)  # (token step, what happened)
    markers_left_out: int = 0

    def seconds_at(self, step: int) -> float:
        """Seconds since the first event at ``step`` (at its point's first step)."""
        if not self.steps:
            return 0.0
        return self.seconds[max(0, bisect.bisect_right(self.steps, step) - 1)]


class SeriesObserver:
    """Per token step samples into at most ``max_points`` points, and ops
    offered per request. Use as ``observer`` and its :meth:`clock` as
    ``clock`` of :func:`~replay.runner.replay`; call :meth:`finish` after."""

    def __init__(self, max_points: int = MAX_POINTS) -> None:
        self.max_points = max_points
        self.width = 1
        self.steps: list[int] = []
        self.seconds: list[float] = []
        self.values: dict[str, list[int]] = {key: [] for key in SERIES}
        self.offered: Tally[str] = Tally()
        self.last_step = 0
        self.token_steps = 0
        self.markers: list[tuple[int, str]] = []
        self.markers_left_out = 0
        self._current: dict[str, int] | None = None
        self._step = 0
        self._seconds = 0.0
        self._wall_s = 0.0
        self._t0_s: float | None = None
        self._base: tuple[int, ...] = (0,) * (1 + len(DropCause))  # submitted, then by cause
        self._last = self._base

    def clock(self, wall_time_s: float) -> None:
        if self._t0_s is None:
            self._t0_s = wall_time_s
        self._wall_s = wall_time_s - self._t0_s

    def __call__(self, seq: int, event: Event, outcome: Outcome, state: State) -> None:
        kind = type(event)
        if kind is CandidateOffered:
            self.offered[event.req_id] += 1  # type: ignore[union-attr]
            return
        if kind in MARKED:
            if len(self.markers) < MAX_MARKERS:
                self.markers.append((state.step_index, MARKED[kind]))
            else:
                self.markers_left_out += 1
            return
        if kind is StepScheduled or kind is StepsPassed:
            if kind is StepScheduled and not event.scheduled_tokens:  # type: ignore[union-attr]
                return
            self.finish()
            self._step = self.last_step = state.step_index
            self.token_steps += len(event.steps) if kind is StepsPassed else 1  # type: ignore[union-attr]
            self._base = self._last
            self._seconds = self._wall_s
        elif (kind is not HashesRead and kind is not FreeQueueRead) or self._current is None:
            return
        counters = state.counters
        now = (counters[Counter.SUBMITTED_OPS], *(counters[name] for name in _DROPPED))
        self._current = {
            "free_blocks": state.free_blocks, "depth_blocks": state.depth_blocks,
            "pinned_blocks": len(state.pins),
            "buffered_ops": sum(len(rec.ops) for rec in state.pending.values()),
            "submitted_ops": now[0] - self._base[0],
            "dropped_ops": sum(now[1:]) - sum(self._base[1:]),
            **{dropped_key(cause): now[1 + n] - self._base[1 + n]
               for n, cause in enumerate(DROPPED_OPS)},
        }
        self._last = now

    def finish(self) -> None:
        """Commit the last step's sample."""
        if self._current is None:
            return
        sample, self._current = self._current, None
        if self.steps and self.steps[-1] // self.width == self._step // self.width:
            for key, merge in SERIES.items():
                self.values[key][-1] = merge(self.values[key][-1], sample[key])
            return
        self.steps.append(self._step)
        self.seconds.append(self._seconds)
        for key in SERIES:
            self.values[key].append(sample[key])
        if len(self.steps) > self.max_points:
            self._halve()

    def _halve(self) -> None:
        self.width *= 2
        steps, seconds, values = self.steps, self.seconds, self.values
        keep = [0] + [i for i in range(1, len(steps))
                      if steps[i] // self.width != steps[i - 1] // self.width]
        for key, merge in SERIES.items():
            merged = []
            for n, start in enumerate(keep):
                end = keep[n + 1] if n + 1 < len(keep) else len(steps)
                value = values[key][start]
                for i in range(start + 1, end):
                    value = merge(value, values[key][i])
                merged.append(value)
            values[key] = merged
        self.steps = [steps[i] for i in keep]
        self.seconds = [seconds[i] for i in keep]


class LaneObserver:
    """The ops of the chosen requests, through an :class:`OpTracker`."""

    def __init__(self, req_ids: Sequence[str]) -> None:
        chosen = set(req_ids)
        self.tracker = OpTracker(chosen.__contains__)

    def __call__(self, seq: int, event: Event, outcome: Outcome, state: State) -> None:
        kind = type(event)
        if kind is CandidateOffered:
            self.tracker.offered(seq, event, outcome, state)  # type: ignore[arg-type]
        elif kind is RequestPreempted:
            self.tracker.preempted(event.req_id)  # type: ignore[union-attr]
        for decision in outcome.decisions:
            self.tracker.decided(decision, state)


def build_timeline(path: str, *, prefix: str | None = None, max_lanes: int = 40,
                   requests: Sequence[str] = ()) -> tuple[Timeline, ReplayResult]:
    """Replay ``path`` (twice unless ``requests`` names the lanes); the
    result is the first replay's (damage, rejection, header)."""
    if not 1 <= max_lanes <= MAX_LANES:
        raise ValueError(f"--lanes {max_lanes}: expected 1..{MAX_LANES}")
    series = SeriesObserver()
    lanes = LaneObserver(requests)

    def both(seq: int, event: Event, outcome: Outcome, state: State) -> None:
        series(seq, event, outcome, state)
        lanes(seq, event, outcome, state)

    result = replay(path, prefix=prefix, observer=both if requests else series,
                    clock=series.clock)
    series.finish()
    if requests:
        chosen = list(requests)
    else:  # the busiest, shown in the order they first offered
        busiest = {req for req, _ in series.offered.most_common(max_lanes)}
        chosen = [req for req in series.offered if req in busiest]
    if not requests:
        lanes = LaneObserver(chosen)
        replay(path, prefix=prefix, observer=lanes)
    lane_list = []
    for req_id in chosen:
        ops = lanes.tracker.of(req_id)
        lane_list.append(Lane(req_id=req_id, offered_ops=series.offered[req_id],
                              ops=ops[:MAX_OPS_PER_LANE],
                              left_out_ops=max(0, len(ops) - MAX_OPS_PER_LANE)))
    timeline = Timeline(steps=series.steps, seconds=series.seconds, width_steps=series.width,
                        series=series.values, last_step=series.last_step,
                        token_steps=series.token_steps, lanes=lane_list,
                        requests_with_ops=len(series.offered),
                        chosen_by="requests" if requests else "busiest",
                        markers=series.markers, markers_left_out=series.markers_left_out)
    return timeline, result
