"""``timeline``: a run at a glance, per token step.

:class:`TimelineObserver` samples, after each token step and its answers:
buffered ops, the danger depth, ops submitted and ops dropped during the
step, and pinned blocks. :func:`write_timeline` writes a self-contained
``.html`` (inline SVG, no scripts, no dependencies) or ``.svg``; ``.png``
needs matplotlib and raises :class:`MissingDependency` without it (this
project does not depend on it).
"""

from __future__ import annotations

import html
from pathlib import Path

from offload_fsm.counters import DROPPED_OPS, Counter
from offload_fsm.events import Event, FreeQueueRead, HashesRead, StepScheduled
from offload_fsm.machine import Outcome
from offload_fsm.state import State

SERIES = (
    ("buffered_ops", "buffered ops", "#1f77b4"),
    ("depth_blocks", "danger depth (blocks)", "#ff7f0e"),
    ("submitted_ops", "submitted ops / step", "#2ca02c"),
    ("dropped_ops", "dropped ops / step", "#d62728"),
    ("pinned_blocks", "pinned blocks", "#9467bd"),
)
_DROPPED = tuple(DROPPED_OPS.values())


class MissingDependency(Exception):
    pass


class TimelineObserver:
    """Samples per token step; submitted/dropped count what happened since
    the previous step's sample (so drops between steps land on the next)."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.samples: dict[str, list[int]] = {key: [] for key, _, _ in SERIES}
        self._base = (0, 0)
        self._last = (0, 0)

    def __call__(self, seq: int, event: Event, outcome: Outcome, state: State) -> None:
        kind = type(event)
        if kind is StepScheduled:
            if not event.scheduled_tokens:  # type: ignore[union-attr]
                return
            self.steps.append(state.step_index)
            for values in self.samples.values():
                values.append(0)
            self._base = self._last
        elif (kind is not HashesRead and kind is not FreeQueueRead) or not self.steps:
            return
        counters = state.counters
        submitted = counters[Counter.SUBMITTED_OPS]
        dropped = sum(counters[name] for name in _DROPPED)
        samples = self.samples
        samples["buffered_ops"][-1] = sum(len(rec.ops) for rec in state.pending.values())
        samples["depth_blocks"][-1] = state.depth_blocks
        samples["submitted_ops"][-1] = submitted - self._base[0]
        samples["dropped_ops"][-1] = dropped - self._base[1]
        samples["pinned_blocks"][-1] = len(state.pins)
        self._last = (submitted, dropped)


def _panel(steps: list[int], values: list[int], label: str, color: str, width: int,
           height: int, top: int) -> str:
    left, right = 60, 10
    inner_w, inner_h = width - left - right, height - 30
    peak = max(values) if values else 0
    peak = peak or 1
    n = max(1, len(values) - 1)
    points = " ".join(
        f"{left + inner_w * i / n:.1f},{top + 20 + inner_h * (1 - v / peak):.1f}"
        for i, v in enumerate(values)
    )
    first, last = (steps[0], steps[-1]) if steps else (0, 0)
    return (
        f'<text x="{left}" y="{top + 14}" font-size="13">{html.escape(label)} '
        f'(max {max(values) if values else 0})</text>'
        f'<line x1="{left}" y1="{top + 20 + inner_h}" x2="{left + inner_w}" '
        f'y2="{top + 20 + inner_h}" stroke="#999"/>'
        f'<text x="{left - 5}" y="{top + 24}" font-size="10" text-anchor="end">{peak}</text>'
        f'<text x="{left - 5}" y="{top + 20 + inner_h}" font-size="10" '
        f'text-anchor="end">0</text>'
        f'<text x="{left}" y="{top + 32 + inner_h}" font-size="10">step {first}</text>'
        f'<text x="{left + inner_w}" y="{top + 32 + inner_h}" font-size="10" '
        f'text-anchor="end">step {last}</text>'
        f'<polyline fill="none" stroke="{color}" stroke-width="1" points="{points}"/>'
    )


def render_svg(observer: TimelineObserver, title: str, *, width: int = 1000,
               panel_height: int = 140) -> str:
    parts = [f'<text x="10" y="20" font-size="15">{html.escape(title)}</text>']
    top = 30
    for key, label, color in SERIES:
        parts.append(_panel(observer.steps, observer.samples[key], label, color, width,
                            panel_height - 20, top))
        top += panel_height
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{top + 10}" '
            f'font-family="sans-serif">{"".join(parts)}</svg>')


def write_timeline(observer: TimelineObserver, path: str, title: str) -> None:
    target = Path(path)
    suffix = target.suffix.lower()
    if suffix == ".png":
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise MissingDependency(
                "writing .png needs matplotlib, which is not installed; "
                "write .html or .svg instead (no dependencies)"
            ) from None
        figure, axes = plt.subplots(len(SERIES), 1, sharex=True, figsize=(12, 10))
        for axis, (key, label, color) in zip(axes, SERIES, strict=True):
            axis.plot(observer.steps, observer.samples[key], color=color, linewidth=0.8)
            axis.set_ylabel(label, fontsize=8)
        axes[-1].set_xlabel("token step")
        figure.suptitle(title)
        figure.savefig(target)
        return
    svg = render_svg(observer, title)
    if suffix == ".svg":
        target.write_text(svg)
    elif suffix in (".html", ".htm"):
        target.write_text(
            f"<!doctype html><html><head><meta charset=\"utf-8\"><title>{html.escape(title)}"
            f"</title></head><body>{svg}</body></html>\n"
        )
    else:
        raise ValueError(f"{path}: expected a .html, .svg or .png file name")
