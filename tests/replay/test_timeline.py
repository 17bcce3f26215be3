"""``replay timeline`` on real recorded logs: the series and the lanes against
the log's own events and decisions, the figure's content, the bounds, the
missing extra, and the page as a real headless Chromium draws it."""

from __future__ import annotations

import sys
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import pytest

from logfiles.scan import Entry, read_log
from offload_fsm.log.records import Inputs
from offload_fsm.state import State
from offload_fsm.vocabulary.decisions import (
    DropCause,
    OpRejected,
    OpsDropped,
    OpSplit,
    StoreSettled,
)
from offload_fsm.vocabulary.events import CandidateOffered, Event, StepScheduled
from offload_fsm.vocabulary.outcome import Outcome
from replay.opstory import DROP_WHY
from replay.runner import replay
from replay.timeline import (
    MAX_POINTS,
    SERIES,
    SeriesObserver,
    Timeline,
    build_timeline,
    dropped_key,
)
from replay.timeline_plot import COLOURS, figure, outcome_of, write_html
from testkit import browser
from testkit.env import require_program
from tests.replay.conftest import run_cli

DATA = Path(__file__).parents[1] / "data"
SIM = DATA / "sim_logs" / "sim-ea-3"  # a real simulator run (the current core replays all of it)
GOLDEN = DATA / "logs" / "v3"


def _inputs(path: Path) -> list[Inputs]:
    return [e.record for e in read_log(path) if isinstance(e, Entry)
            and isinstance(e.record, Inputs)]


def _fetched(text: str) -> list[str]:
    """What the page's tags would fetch (``src``/``href`` of script, link, img)."""
    found: list[str] = []

    class Tags(HTMLParser):
        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            if tag in ("script", "link", "img", "iframe"):
                found.extend(v or "" for k, v in attrs if k in ("src", "href"))

    Tags().feed(text)
    return found


@pytest.fixture(scope="module")
def sim() -> Timeline:
    return build_timeline(str(SIM))[0]


def test_lanes_are_the_busiest_requests_and_every_op_ends_as_the_core_decided(
        sim: Timeline) -> None:
    offers: Counter[str] = Counter()
    for record in _inputs(SIM):
        for event in record.events:
            if isinstance(event, CandidateOffered):
                offers[event.req_id] += 1
    busiest = {req for req, _ in offers.most_common(40)}
    assert [lane.req_id for lane in sim.lanes] == [req for req in offers if req in busiest]
    assert sim.requests_with_ops == len(offers) == 571 and sim.chosen_by == "busiest"
    chosen = set(busiest)
    expected: Counter[tuple[str, str]] = Counter()
    splits: Counter[str] = Counter()  # a split op is two stories: its front and its rest

    def tally(seq: int, event: Event, outcome: Outcome, state: State) -> None:
        for d in outcome.decisions:
            req = getattr(d, "req_id", None)
            if req not in chosen:
                continue
            if isinstance(d, OpSplit):
                splits[req] += 1
            if isinstance(d, StoreSettled):
                expected[(req, "failed" if d.failed else "stored")] += d.ops
            elif isinstance(d, OpsDropped) and d.ops:
                expected[(req, f"dropped: {d.cause.value}")] += d.ops
            elif isinstance(d, OpRejected):
                expected[(req, "rejected")] += 1

    replay(SIM, observer=tally)
    got = Counter((lane.req_id, outcome_of(op)) for lane in sim.lanes for op in lane.ops)
    assert got == expected
    assert {label for _, label in got} >= {"stored", "dropped: evicted", "dropped: duplicate"}
    for lane in sim.lanes:
        assert len(lane.ops) == offers[lane.req_id] + splits[lane.req_id]
        assert not lane.left_out_ops
        for op in lane.ops:
            assert 0 <= op.buffered_step <= op.ended_step <= sim.last_step


def test_the_figure_draws_the_pool_the_ops_and_one_lane_per_request(sim: Timeline) -> None:
    fig = figure(sim, "sim")
    names = [trace.name for trace in fig.data]
    for name in ("free pool (blocks)", "danger depth (blocks)", "pinned blocks",
                 "buffered ops", "submitted ops", "dropped ops: evicted",
                 "dropped ops: duplicate"):
        assert name in names
    lanes = [trace for trace in fig.data if trace.type == "bar" and trace.orientation == "h"]
    by_label = {trace.legendgroup: trace for trace in lanes}
    ops = [op for lane in sim.lanes for op in lane.ops]
    assert sum(len(trace.x) for trace in lanes) == len(ops)
    for label, trace in by_label.items():
        mine = [op for op in ops if outcome_of(op) == label]
        assert trace.name == f"{label} ({len(mine)})"
        assert trace.marker.color == COLOURS[label]
        assert sorted(trace.base) == sorted(op.buffered_step for op in mine)
        assert sorted(b + x for b, x in zip(trace.base, trace.x, strict=True)) == \
            sorted(max(op.ended_step, op.buffered_step + 0.5) for op in mine)
    evicted = by_label["dropped: evicted"].hovertext
    assert all(DROP_WHY["evicted"] in text and "block " in text for text in evicted)
    assert all(text.startswith("<b>s") and "tokens [" in text and "op " in text
               for trace in lanes for text in trace.hovertext)
    layout = fig.layout
    assert layout.yaxis4.ticktext == tuple(lane.req_id for lane in sim.lanes)
    assert layout.xaxis3.title.text == "token step"
    assert layout.xaxis4.title.text == "seconds since the first event"
    assert layout.yaxis.title.text == "blocks"
    assert any("40 requests with the most ops, of 571 (531 left out" in a.text
               for a in layout.annotations)


def test_the_series_are_bounded_and_merge_the_steps_they_stand_for(sim: Timeline) -> None:
    raw = SeriesObserver(max_points=10**6)
    replay(SIM, observer=raw, clock=raw.clock)
    raw.finish()
    steps = [e for r in _inputs(SIM) for e in r.events
             if isinstance(e, StepScheduled) and e.scheduled_tokens]
    assert raw.width == 1 and len(raw.steps) == len(steps) == sim.token_steps == 4133
    assert raw.values["free_blocks"] == [e.free_blocks for e in steps]
    assert len(sim.steps) <= MAX_POINTS and sim.width_steps == 4
    for key, merge in SERIES.items():
        buckets: dict[int, int] = {}
        for step, value in zip(raw.steps, raw.values[key], strict=True):
            slot = step // sim.width_steps
            buckets[slot] = merge(buckets[slot], value) if slot in buckets else value
        assert sim.series[key] == list(buckets.values()), key
    walls = [r.wall_time_s for r in _inputs(SIM)]
    assert raw.seconds[0] == 0.0 and raw.seconds == sorted(raw.seconds)
    assert 0 < raw.seconds[-1] <= walls[-1] - walls[0]


def test_requests_pick_the_lanes_and_the_cli_says_what_it_drew(tmp_path: Path) -> None:
    timeline, _ = build_timeline(str(SIM), requests=["s45t0", "s80t1"])
    assert [lane.req_id for lane in timeline.lanes] == ["s45t0", "s80t1"]
    (trimmed,) = timeline.lanes[0].ops
    assert (trimmed.status, trimmed.trimmed_tokens, trimmed.start_token) == ("stored", 2304,
                                                                              2304)
    assert [outcome_of(op) for op in timeline.lanes[1].ops] == ["dropped: duplicate",
                                                                "dropped: evicted"]
    page = tmp_path / "two.html"
    code, out, err = run_cli("timeline", str(SIM), "-o", str(page), "--requests", "s45t0,s80t1")
    assert code == 0, err
    assert "4133 token steps in 1034 points; store ops of the 2 requests asked for" in out
    assert "first 2304 tokens trimmed: duplicate" in page.read_text()


def test_the_page_is_self_contained(tmp_path: Path) -> None:
    timeline, _ = build_timeline(str(GOLDEN))
    page = tmp_path / "golden.html"
    write_html(timeline, page, "golden")
    text = page.read_text()
    assert "plotly.js v" in text and "Plotly.newPlot" in text
    assert _fetched(text) == []  # no script, style sheet or image from anywhere
    assert "left out" not in figure(timeline, "golden").layout.annotations[-1].text
    assert timeline.requests_with_ops == len(timeline.lanes) > 0


def test_without_plotly_the_error_names_the_extra(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    for module in [m for m in sys.modules if m == "plotly" or m.startswith("plotly.")]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.setitem(sys.modules, "plotly", None)  # import plotly raises ImportError
    code, _, err = run_cli("timeline", str(GOLDEN), "-o", str(tmp_path / "t.html"))
    assert code == 2 and "'plot' extra" in err and "plotly" in err
    assert not (tmp_path / "t.html").exists()


def test_bad_lanes_and_missing_directories_are_usage_errors(tmp_path: Path) -> None:
    code, _, err = run_cli("timeline", str(GOLDEN), "-o", str(tmp_path / "t.html"), "--lanes", "0")
    assert code == 2 and "--lanes 0: expected 1..200" in err
    code, _, err = run_cli("timeline", str(GOLDEN), "-o", str(tmp_path / "no" / "t.html"))
    assert code == 2 and "No such file or directory" in err


def test_a_headless_chromium_draws_the_timeline(sim: Timeline, tmp_path: Path) -> None:
    chromium = require_program(*browser.CHROMIUM, install=browser.INSTALL)
    page, png = tmp_path / "sim.html", tmp_path / "sim.png"
    write_html(sim, page, "sim-ea-3")
    done = browser.screenshot(chromium, page, png)
    assert done.returncode == 0 and png.exists(), done.stderr[-2000:]
    colours = ("#2ca02c", "#d62728", "#aaaaaa", "#1f77b4", "#ff7f0e")
    seen = browser.ink(png, colours)
    print(f"screenshot {seen.width}x{seen.height}: {seen.inked} inked pixels "
          f"({seen.fraction:.1%}), {seen.colours} colours, near {seen.near}")
    assert (seen.width, seen.height) == (1400, 1200)
    assert seen.fraction > 0.02 and seen.colours > 50
    # stored and evicted bars, duplicate drops, the free pool and the danger depth
    assert all(seen.near[c] > 200 for c in colours), seen.near
    drawn = browser.dom(chromium, page)  # plotly's own SVG, legend and lane labels
    assert drawn.count('class="main-svg"') >= 2 and "dropped: evicted (1)" in drawn
    assert all(f">{lane.req_id}<" in drawn for lane in sim.lanes)
    blank, blank_png = tmp_path / "blank.html", tmp_path / "blank.png"
    blank.write_text("<!doctype html><html><body></body></html>")
    assert browser.screenshot(chromium, blank, blank_png).returncode == 0
    assert browser.ink(blank_png).inked == 0  # the measure tells an empty page


def test_every_drop_bar_names_its_cause_and_the_colours_tell_things_apart(
        sim: Timeline) -> None:
    """Submitted is not drawn in the lanes' "stored" green; the drops per
    step are one bar per cause, in the cause's lane colour, stacked on the
    submitted ops, and they add up to the dropped series."""
    fig = figure(sim, "sim")
    steps = [t for t in fig.data if t.type == "bar" and t.orientation != "h"]
    submitted = next(t for t in steps if t.name == "submitted ops")
    assert submitted.marker.color != COLOURS["stored"]
    drops = [t for t in steps if t.name.startswith("dropped ops: ")]
    assert {t.name for t in drops} == {f"dropped ops: {cause.value}" for cause in DropCause
                                       if any(sim.series[dropped_key(cause)])}
    assert len(drops) >= 3
    for trace in drops:
        cause = trace.name.removeprefix("dropped ops: ")
        assert trace.marker.color == COLOURS[f"dropped: {cause}"]
        assert DROP_WHY[cause] in trace.hovertemplate
    total = [sum(values) for values in zip(*(t.y for t in drops), strict=True)]
    assert total == sim.series["dropped_ops"]
    top = [b + y for b, y in zip(drops[-1].base, drops[-1].y, strict=True)]
    assert top == [s + d for s, d in zip(sim.series["submitted_ops"],
                                         sim.series["dropped_ops"], strict=True)]
    colours = [trace.line.color for trace in fig.data if trace.type == "scatter"
               and trace.mode == "lines"] + [submitted.marker.color]
    assert len(set(colours)) == len(colours)


def test_resets_and_the_shutdown_are_marked(tmp_path: Path) -> None:
    from connector.recorder.recording import EventRecorder
    from tests.offload_fsm.helpers import Harness, ea
    from tests.replay.conftest import VERSIONS

    h = Harness(ea())
    h.arrive("a")
    h.offer("a")
    h.queue = list(range(100, 140))
    h.tick(allocated=8, next_blocks=8)
    h.tick(allocated=8, next_blocks=8)
    h.finish("a", free=1000)
    h.reset_cache()
    h.tick(allocated=8, next_blocks=8)
    h.shutdown()
    recorder = EventRecorder(h.state.config, 1, str(tmp_path), VERSIONS, prefix="run",
                             register_atexit=False)
    recorder.record(h.log, h.state)
    recorder.close(h.state)
    timeline, _ = build_timeline(str(tmp_path))
    assert timeline.markers == [(2, "prefix-cache reset"), (3, "shutdown")]
    fig = figure(timeline, "t")
    lines = [shape for shape in fig.layout.shapes if shape.type == "line"]
    assert sorted({shape.x0 for shape in lines}) == [2, 3]
    texts = [a.text for a in fig.layout.annotations]
    assert "prefix-cache reset" in texts and "shutdown" in texts
    (reset_bar,) = [t for t in fig.data if t.name == "dropped ops: cache_reset"]
    assert sum(reset_bar.y) == 1
