"""The timeline picture: a :class:`~replay.timeline.Timeline` as a plotly figure
in one self-contained HTML file (plotly.js embedded: it opens offline).

Needs the optional ``plot`` extra (plotly); without it :func:`figure` raises
:class:`MissingDependency` naming the extra. Three panels share the x axis
of token steps (seconds since the first event on the top axis and in every
hover): 1. the free pool, the danger depth and pinned blocks (blocks);
2. buffered ops, and per step the ops submitted and, stacked on them, the
ops dropped by cause (each cause in its lane colour, and its meaning in the
hover); 3. one lane per
request, each store op a bar from the step it was offered to the step it
ended, coloured by outcome (drops by cause; a cross marks the end of every
op that was not stored), its hover naming request, op id, token range,
steps, outcome, cause and, for an eviction, the block and who reused it.
A dashed line across the panels marks every prefix-cache reset and the
shutdown.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from offload_fsm.vocabulary.decisions import DropCause
from replay.opstory import DROP_WHY, OpStory
from replay.timeline import Lane, Timeline, dropped_key

PLOT_EXTRA = ("the timeline needs plotly, which is not installed: install the 'plot' extra "
              "(pip install 'lazy-offload-fsm[plot]', or .venv/bin/python -m pip install "
              "'plotly>=6')")

# outcome label -> colour; drops by cause. Open: still buffered or in flight at the end.
COLOURS = {
    "stored": "#2ca02c", "failed": "#8c564b", "abandoned": "#7f7f7f",
    "rejected": "#bcbd22", "open at the end": "#1f77b4",
    "dropped: evicted": "#d62728", "dropped: stale": "#ff7f0e",
    "dropped: shutdown": "#9467bd", "dropped: preempted": "#e377c2",
    "dropped: id_reuse": "#17becf", "dropped: store_failed": "#843c39",
    "dropped: cache_reset": "#ff9896", "dropped: duplicate": "#aaaaaa",
}
LINES = (  # (series key, row, label, colour)
    ("free_blocks", 1, "free pool (blocks)", "#1f77b4"),
    ("depth_blocks", 1, "danger depth (blocks)", "#ff7f0e"),
    ("pinned_blocks", 1, "pinned blocks", "#9467bd"),
    ("buffered_ops", 2, "buffered ops", "#17becf"),
)
SUBMITTED_COLOUR = "#e7ba52"  # not the lanes' "stored" green: submitted is not stored yet
MARKER_COLOURS = {"prefix-cache reset": "#ff9896", "shutdown began": "#9467bd",
                  "shutdown": "#9467bd"}


class MissingDependency(Exception):
    pass


def outcome_of(op: OpStory) -> str:
    if op.status == "dropped":
        return f"dropped: {op.cause}"
    if op.status in COLOURS:
        return op.status
    return "open at the end"


def digits(timeline: Timeline) -> int:
    """Decimals that tell seconds apart over the run's span."""
    span = timeline.seconds[-1] if timeline.seconds else 0.0
    return 3 if span < 1 else 2 if span < 10 else 1 if span < 1000 else 0


def _hover(lane: Lane, op: OpStory, timeline: Timeline, end: int) -> str:
    places = digits(timeline)

    def at(step: int) -> str:
        return f"{timeline.seconds_at(step):.{places}f}"

    gen = f" (generation {op.generation})" if op.generation else ""
    trimmed = f", first {op.trimmed_tokens} tokens trimmed: duplicate" \
        if op.trimmed_tokens else ""
    lines = [f"<b>{lane.req_id}</b>{gen}",
             f"op {op.op_id if op.op_id >= 0 else '-'}: tokens [{op.start_token}, "
             f"{op.end_token}){trimmed}",
             f"offered at step {op.buffered_step} ({at(op.buffered_step)} s)"]
    if op.selected_step >= 0:
        lines.append(f"selected at step {op.selected_step} (batch {op.batch_id})")
    outcome = outcome_of(op)
    if op.status == "dropped":
        outcome += f": {DROP_WHY[op.cause]}"
        if op.block_id >= 0:
            outcome += f"; block {op.block_id}"
        if op.reused_by:
            outcome += f" reused by {op.reused_by}"
    elif op.status == "rejected":
        outcome += f": {op.cause}"
    elif outcome == "open at the end":
        outcome = f"still {op.status} at the end of the log"
    lines.append(f"<b>{outcome}</b> at step {end} ({at(end)} s)")
    return "<br>".join(lines)


def _lane_traces(go: Any, timeline: Timeline) -> list[Any]:
    """One bar trace (and one end-marker trace) per outcome, across all lanes."""
    groups: dict[str, dict[str, list[Any]]] = {}
    for row, lane in enumerate(timeline.lanes):
        count = max(1, len(lane.ops))
        for index, op in enumerate(lane.ops):
            end = op.ended_step if op.ended_step >= 0 else timeline.last_step
            group = groups.setdefault(outcome_of(op), {k: [] for k in
                                                       ("base", "x", "y", "width", "text")})
            group["base"].append(op.buffered_step)
            group["x"].append(max(end - op.buffered_step, 0.5))
            group["y"].append(row - 0.4 + 0.8 * (index + 0.5) / count)
            group["width"].append(0.8 / count * 0.9)
            group["text"].append(_hover(lane, op, timeline, end))
    traces = []
    for label in COLOURS:
        if label not in groups:
            continue
        group = groups[label]
        name = f"{label} ({len(group['x'])})"
        traces.append(go.Bar(orientation="h", base=group["base"], x=group["x"], y=group["y"],
                             width=group["width"], name=name, legendgroup=label,
                             marker_color=COLOURS[label], hovertext=group["text"],
                             hoverinfo="text"))
        if label != "stored" and label != "open at the end":
            ends = [b + x for b, x in zip(group["base"], group["x"], strict=True)]
            traces.append(go.Scatter(x=ends, y=group["y"], mode="markers", name=name,
                                     legendgroup=label, showlegend=False,
                                     marker={"symbol": "x-thin", "size": 7,
                                             "line": {"width": 2, "color": COLOURS[label]}},
                                     hovertext=group["text"], hoverinfo="text"))
    return traces


def lanes_note(timeline: Timeline) -> str:
    shown = len(timeline.lanes)
    if timeline.chosen_by == "requests":
        text = f"store ops of the {shown} requests asked for"
    else:
        left = timeline.requests_with_ops - shown
        text = (f"store ops of the {shown} requests with the most ops, of "
                f"{timeline.requests_with_ops}" + (f" ({left} left out: --lanes N or "
                                                   "--requests ID,...)" if left else ""))
    cut = sum(lane.left_out_ops for lane in timeline.lanes)
    return text + (f"; {cut} ops past the first of each lane left out" if cut else "")


def require_plotly() -> tuple[Any, Any]:
    """``plotly.graph_objects`` and ``plotly.subplots.make_subplots``."""
    try:
        import plotly.graph_objects as go
        from plotly.subplots import make_subplots
    except ImportError:
        raise MissingDependency(PLOT_EXTRA) from None
    return go, make_subplots


def check_target(path: str | Path) -> None:
    if Path(path).suffix.lower() not in (".html", ".htm"):
        raise ValueError(f"-o {path}: expected FILE.html (an interactive page, "
                         "plotly.js embedded, opens offline)")


def figure(timeline: Timeline, title: str) -> Any:
    go, make_subplots = require_plotly()
    per = "step" if timeline.width_steps == 1 else f"{timeline.width_steps} steps"
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        row_heights=[0.25, 0.2, 0.55],
                        specs=[[{}], [{"secondary_y": True}], [{}]],
                        subplot_titles=("", f"ops buffered (left), submitted and dropped "
                                        f"per {per} (right)", lanes_note(timeline)))
    steps, seconds, places = timeline.steps, timeline.seconds, digits(timeline)
    where = "step %{x}" if timeline.width_steps == 1 else \
        f"step %{{x}} (a point per {timeline.width_steps} steps)"
    for key, row, label, colour in LINES:
        fig.add_trace(go.Scatter(x=steps, y=timeline.series[key], customdata=seconds,
                                 name=label, mode="lines", line={"color": colour, "width": 1.2},
                                 hovertemplate=f"{where} (%{{customdata:.{places}f}} s): %{{y}} "
                                 f"{label}<extra></extra>"), row=row, col=1)
    for trace in _step_bars(go, timeline, where, places):
        fig.add_trace(trace, row=2, col=1, secondary_y=True)
    for trace in _lane_traces(go, timeline):
        fig.add_trace(trace, row=3, col=1)
    rows = len(timeline.lanes)
    fig.update_yaxes(title_text="blocks", row=1, col=1)
    fig.update_yaxes(title_text="ops buffered", row=2, col=1, secondary_y=False)
    peak = max([1, *timeline.series["submitted_ops"], *timeline.series["dropped_ops"]])
    fig.update_yaxes(title_text=f"ops per {per}", row=2, col=1, secondary_y=True,
                     showgrid=False, range=[0, peak * 1.05], dtick=max(1, -(-peak // 5)))
    fig.update_yaxes(title_text="request", row=3, col=1, autorange="reversed",
                     tickmode="array", tickvals=list(range(rows)),
                     ticktext=[lane.req_id for lane in timeline.lanes], range=[rows - 0.5, -0.5])
    fig.update_xaxes(title_text="token step", row=3, col=1)
    _markers(fig, timeline)
    _seconds_axis(go, fig, timeline)
    fig.update_layout(title=title, barmode="overlay", hovermode="closest",
                      height=520 + 16 * max(rows, 10), template="plotly_white",
                      legend={"groupclick": "togglegroup"}, margin={"t": 110})
    return fig


def _step_bars(go: Any, timeline: Timeline, where: str, places: int) -> list[Any]:
    """Ops submitted per point, and on top of them the ops dropped, one bar
    per cause in its lane colour (stacked: no bar hides another)."""
    series = timeline.series
    seconds = timeline.seconds
    base = list(series["submitted_ops"])
    traces = [go.Bar(x=timeline.steps, y=base, customdata=seconds, name="submitted ops",
                     marker_color=SUBMITTED_COLOUR, width=timeline.width_steps, offset=0,
                     hovertemplate=f"{where} (%{{customdata:.{places}f}} s): %{{y}} "
                     "submitted ops<extra></extra>")]
    for cause in DropCause:
        values = series[dropped_key(cause)]
        if not any(values):
            continue
        label = f"dropped: {cause.value}"
        traces.append(go.Bar(
            x=timeline.steps, y=values, base=list(base), customdata=seconds,
            name=f"dropped ops: {cause.value}", legendgroup=label,
            marker_color=COLOURS[label], width=timeline.width_steps, offset=0,
            hovertemplate=f"{where} (%{{customdata:.{places}f}} s): %{{y}} ops dropped, "
            f"{cause.value}: {DROP_WHY[cause.value]}<extra></extra>"))
        base = [b + v for b, v in zip(base, values, strict=True)]
    return traces


def _markers(fig: Any, timeline: Timeline) -> None:
    """A dashed line across the panels at every reset and shutdown."""
    for step, label in timeline.markers:
        fig.add_vline(x=step, line={"color": MARKER_COLOURS[label], "dash": "dash",
                                    "width": 1.5}, row="all", col=1)
        fig.add_annotation(x=step, y=1.0, yref="paper", text=label, showarrow=False,
                           textangle=-90, xanchor="right", yanchor="top",
                           font={"size": 10, "color": MARKER_COLOURS[label]})
    if timeline.markers_left_out:
        fig.add_annotation(x=1.0, y=1.0, xref="paper", yref="paper", showarrow=False,
                           text=f"{timeline.markers_left_out} more resets/shutdowns not marked",
                           xanchor="right", yanchor="bottom", font={"size": 10})


def _seconds_axis(go: Any, fig: Any, timeline: Timeline, ticks: int = 10) -> None:
    """Seconds since the first event along the top of the first panel."""
    if not timeline.steps:
        return
    first, last = timeline.steps[0], max(timeline.last_step, timeline.steps[0] + 1)
    values = sorted({first + (last - first) * i // ticks for i in range(ticks + 1)})
    fig.add_trace(go.Scatter(x=[first, last], y=[None, None], xaxis="x4", yaxis="y",
                             showlegend=False, hoverinfo="skip"))
    fig.update_layout(xaxis4={"overlaying": "x", "matches": "x3", "side": "top",
                              "tickmode": "array", "tickvals": values,
                              "ticktext": [f"{timeline.seconds_at(v):.{digits(timeline)}f} s"
                                           for v in values],
                              "title": {"text": "seconds since the first event",
                                        "standoff": 4}, "showgrid": False})


def write_html(timeline: Timeline, path: str | Path, title: str) -> None:
    check_target(path)
    fig = figure(timeline, title)
    fig.write_html(Path(path), include_plotlyjs=True, full_html=True,
                   config={"displaylogo": False, "responsive": True})
