"""One arm's results, and the Markdown tables ``bench.simulate`` prints from them.

Contract: :class:`ArmResult` is what one run of one arm measured: per step, the
scheduler's and the connector's milliseconds (instrumentation subtracted) and
the backlog at the step's start; over the run, the decisions' counts (ledger,
writes, preemptions, losses by mechanism), the ground truth's recall and the
cyclic GC's collections. The simulator fills it as it runs; nothing here
changes it. :func:`percentile` is the one percentile every table (and
``bench.profile_steps``) uses: the nearest rank, ``nan`` for no samples. The
table functions turn a config's results into rows; every ratio is against the
``stock eager`` arm (and preemptions against ``none``) of the same config.
Metric definitions: bench/README.md.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field


def percentile(xs: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ``xs`` (``nan`` when empty)."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(math.ceil(q * len(s))) - 1))]


@dataclass
class ArmResult:
    arm: str
    steps: int = 0
    token_steps: int = 0
    sched_ms: list[float] = field(default_factory=list)
    conn_ms: list[float] = field(default_factory=list)
    backlog: list[int] = field(default_factory=list)
    preemptions: int = 0
    chunk_writes: int = 0
    store_batches: int = 0
    finished_requests: int = 0
    lmcache_hit_tokens: int = 0
    prompt_tokens: int = 0
    computed_tokens: int = 0
    needed: int = 0
    recalled: int = 0
    written_keys: int = 0
    useful_written_keys: int = 0
    ledger: dict[str, int] = field(default_factory=dict)
    losses: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    max_backlog: int = 0
    max_running: int = 0
    unfinished_sessions: int = 0
    # the cyclic GC's collections while serving (any thread), by generation, and their pauses
    gc_collections: list[int] = field(default_factory=lambda: [0, 0, 0])
    gc_pause_ms: float = 0.0
    # ours with the log on (bench.sim.recorder): the recorder process's CPU while
    # serving and up to its exit after END (seconds), the wall from the close to
    # that exit, a note ("restarted", "did not exit"), and the hand-off's counters
    recorder_cpu_s: float = float("nan")
    recorder_total_cpu_s: float = float("nan")
    recorder_drain_s: float = float("nan")
    recorder_note: str = ""
    log_events_lost: int = 0
    log_bytes_in_flight_max: int = 0
    log_bytes_sent: int = 0  # handed to the recorder (its last start's), messages' bytes

    def conn_by_bucket(self) -> dict[str, tuple[int, float, float]]:
        out: dict[str, list[float]] = {"0-99": [], "100-999": [], "1000+": []}
        for b, c in zip(self.backlog, self.conn_ms, strict=True):
            out["0-99" if b < 100 else "100-999" if b < 1000 else "1000+"].append(c)
        return {k: (len(v), percentile(v, 0.5), percentile(v, 0.99)) for k, v in out.items()}


def fmt(x: float, nd: int = 3) -> str:
    return "-" if x != x else f"{x:.{nd}f}"


HEAD = ["arm", "step p50 ms", "step p99 ms", "conn p50 ms", "conn p99 ms", "conn p99.9 ms",
        "conn max ms", "preempt",
        "ops admitted", "ops submitted", "ops dropped", "dropped by cause", "pending@end",
        "chunk writes", "distinct chunks", "writes/eager", "recalled/needed", "recall", "precision",
        "max backlog", "steps", "gc collections 0/1/2 (ms)"]


def row(r: ArmResult, eager: ArmResult | None) -> list[str]:
    """The main table's row of ``r`` (columns: :data:`HEAD`)."""
    led = r.ledger
    dropped = {k[8:]: v for k, v in led.items() if k.startswith("dropped_") and v}
    recall = r.recalled / r.needed if r.needed else float("nan")
    precision = r.useful_written_keys / r.written_keys if r.written_keys else float("nan")
    wr = (r.chunk_writes / eager.chunk_writes) if eager and eager.chunk_writes else float("nan")
    tok = [c for c, b in zip(r.conn_ms, r.backlog, strict=True)]
    return [
        r.arm,
        fmt(percentile(r.sched_ms, 0.5), 2), fmt(percentile(r.sched_ms, 0.99), 2),
        fmt(percentile(tok, 0.5), 3), fmt(percentile(tok, 0.99), 3),
        fmt(percentile(tok, 0.999), 3), fmt(max(tok, default=float("nan")), 3),
        str(r.preemptions),
        str(led.get("admitted", "-")), str(led.get("submitted", "-")),
        str(sum(dropped.values())) if led else "-",
        " ".join(f"{k}:{v}" for k, v in sorted(dropped.items())) or "-",
        str(led.get("pending", "-")),
        str(r.chunk_writes), str(r.written_keys), fmt(wr, 2),
        f"{r.recalled}/{r.needed}", fmt(recall), fmt(precision),
        str(r.max_backlog), str(r.steps),
        "/".join(map(str, r.gc_collections)) + f" ({r.gc_pause_ms:.0f})",
    ]


VHEAD = ["arm", "recall", "chunk writes", "writes/eager writes", "writes/eager distinct",
         "step p50 / eager", "step p99 / eager", "conn p50 / eager", "conn p99 / eager",
         "young GC per 1k steps (x eager)", "preempt", "preempt none"]


def versus_row(r: ArmResult, eager: ArmResult | None, none: ArmResult | None) -> list[str]:
    """Recall and writes next to eager's: writes ÷ eager's chunk writes and ÷ eager's
    distinct chunks (the chunks eager stored at least once); step and connector p50/p99 ÷
    eager's; the cyclic GC's young collections per 1,000 steps (÷ eager's)."""
    recall = r.recalled / r.needed if r.needed else float("nan")
    nan = float("nan")

    def ratio(x: float, y: float) -> float:
        return x / y if y and y == y and x == x else nan

    we = ratio(r.chunk_writes, eager.chunk_writes) if eager else nan
    wd = ratio(r.chunk_writes, eager.written_keys) if eager else nan
    p50 = ratio(percentile(r.conn_ms, 0.5), percentile(eager.conn_ms, 0.5)) if eager else nan
    p99 = ratio(percentile(r.conn_ms, 0.99), percentile(eager.conn_ms, 0.99)) if eager else nan
    step50 = ratio(percentile(r.sched_ms, 0.5), percentile(eager.sched_ms, 0.5)) if eager else nan
    step99 = ratio(percentile(r.sched_ms, 0.99), percentile(eager.sched_ms, 0.99)) \
        if eager else nan
    young = ratio(1000 * r.gc_collections[0], r.steps)
    young_eager = ratio(1000 * eager.gc_collections[0], eager.steps) if eager else nan
    return [r.arm, f"{fmt(recall)} ({r.recalled}/{r.needed})", str(r.chunk_writes),
            fmt(we, 2), fmt(wd, 2), fmt(step50, 2), fmt(step99, 2), fmt(p50, 2), fmt(p99, 2),
            f"{fmt(young, 1)} ({fmt(ratio(young, young_eager), 2)})", str(r.preemptions),
            str(none.preemptions) if none else "-"]


def table(rows: list[list[str]], head: list[str]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def rounds_table(rounds: list[list[ArmResult]], times: Callable[[ArmResult], list[float]]) -> str:
    """Each arm's p50 / p99 of ``times`` (the step's, or the connector's, ms per
    step) in every round, over eager's of that round, and the medians of those
    ratios."""
    head = ["arm"] + [f"round {i + 1}: p50 / p99 (x eager)" for i in range(len(rounds))]
    head += ["median p50 / eager", "median p99 / eager"]
    rows = []
    for column, first in enumerate(rounds[0]):
        cells, p50s, p99s = [], [], []
        for results in rounds:
            r = results[column]
            eager = next((e for e in results if e.arm == "stock eager"), None)
            p50, p99 = percentile(times(r), 0.5), percentile(times(r), 0.99)
            if eager is None or not percentile(times(eager), 0.5):
                cells.append(f"{fmt(p50)} / {fmt(p99)}")
                continue
            p50s.append(p50 / percentile(times(eager), 0.5))
            p99s.append(p99 / percentile(times(eager), 0.99))
            cells.append(f"{fmt(p50)} / {fmt(p99)} ({fmt(p50s[-1], 2)} / {fmt(p99s[-1], 2)})")
        rows.append([first.arm, *cells,
                     fmt(statistics.median(p50s), 2) if p50s else "-",
                     fmt(statistics.median(p99s), 2) if p99s else "-"])
    return table(rows, head)


def bucket_table(results: list[ArmResult]) -> str:
    head = ["arm", "backlog 0-99: n / p50 / p99 ms", "100-999: n / p50 / p99",
            "1000+: n / p50 / p99"]
    rows = []
    for r in results:
        b = r.conn_by_bucket()
        rows.append([r.arm] + [f"{n} / {fmt(p50)} / {fmt(p99)}" for n, p50, p99 in b.values()])
    return table(rows, head)


def loss_table(results: list[ArmResult]) -> str:
    mechs = sorted({m for r in results for m in r.losses})
    head = ["arm"] + mechs
    rows = [[r.arm] + [str(r.losses.get(m, 0)) for m in mechs] for r in results if r.ledger]
    return table(rows, head)


LOG_ON, LOG_OFF = "ours EA", "ours EA (log off)"


def _step(results: list[ArmResult], name: str) -> tuple[float, float]:
    r = next((x for x in results if x.arm == name), None)
    if r is None:
        return float("nan"), float("nan")
    return percentile(r.sched_ms, 0.5), percentile(r.sched_ms, 0.99)


def log_cost_table(rounds: list[list[ArmResult]]) -> str:
    """The event log's cost, per round and the medians over rounds: step p50 / p99
    (ms) of ``none``, ``stock eager``, ``ours EA (log off)`` and ``ours EA`` (log
    on), the log-on over log-off ratios at p50 and p99, log on over eager at p50,
    the recorder process's CPU per simulated step (µs) while serving and up to its
    exit after END (``bench.sim.recorder``), and the bytes handed to it per step.
    Empty without both ours arms."""
    names = ["none", "stock eager", LOG_OFF, LOG_ON]
    head = ["round"] + [f"{n} step p50 / p99" for n in names] + [
        "on / off p50", "on / off p99", "on / eager p50",
        "recorder CPU µs/step serving / to exit", "drain after close s", "hand-off B/step",
        "events lost"]
    cols: list[list[float]] = [[] for _ in range(len(names) * 2 + 7)]
    rows = []
    for index, results in enumerate(rounds):
        on = next((x for x in results if x.arm == LOG_ON), None)
        if on is None or not any(x.arm == LOG_OFF for x in results):
            return ""
        steps = [v for n in names for v in _step(results, n)]
        eager50 = steps[2]
        off50, off99, on50, on99 = steps[4:8]
        per = 1e6 / max(1, on.steps)
        values = steps + [on50 / off50, on99 / off99, on50 / eager50 if eager50 else float("nan"),
                          on.recorder_cpu_s * per, on.recorder_total_cpu_s * per,
                          on.recorder_drain_s, on.log_bytes_sent / max(1, on.steps)]
        for col, v in zip(cols, values, strict=False):
            col.append(v)
        rows.append(_log_cost_cells(str(index + 1), values, len(names)) +
                    [str(on.log_events_lost) + (f" ({on.recorder_note})"
                                                if on.recorder_note else "")])
    if len(rounds) > 1:
        med = [statistics.median(c) for c in cols]
        rows.append(_log_cost_cells("median", med, len(names)) + ["-"])
    return table(rows, head)


def _log_cost_cells(label: str, v: list[float], n: int) -> list[str]:
    cells = [label] + [f"{fmt(v[2 * i], 3)} / {fmt(v[2 * i + 1], 3)}" for i in range(n)]
    k = 2 * n
    return cells + [fmt(v[k], 3), fmt(v[k + 1], 3), fmt(v[k + 2], 2),
                    f"{fmt(v[k + 3], 0)} / {fmt(v[k + 4], 0)}", fmt(v[k + 5], 2),
                    fmt(v[k + 6], 0)]
