"""The soak's figures and tables: what one arm's samples and requests come to.

Contract. :func:`figures` turns one arm's result (samples, requests, the state at the
end, the faults, replay's answers) into the row values of the table; :func:`report`
prints every arm that has figures side by side as Markdown, with the RSS over time, the
server log's WARNING and ERROR lines by kind and, for ``ours``, what each fault moved.
Pure functions of the result: no process, no I/O. A figure that cannot be computed is
None and prints as ``-``.

What it measures, and why:
  * engine-core RSS and the recorder's every 10 s, and their least-squares slope per
    hour after the warm-up (the first 5 minutes, or a third of a run shorter than 15
    minutes): a leak in the connector, its core state, the hand-off or the recorder
    shows as a slope;
  * the log directory's size over time against its bound (max seen, files created
    and deleted): retention must hold the bound while a long run rotates;
  * pins and in-flight batches at the end, per engine (``/metrics``), after the
    traffic stopped and the in-flight stores settled: nothing may stay pinned for
    ever; whether the ledger closes from that scrape (as ``tests/e2e/test_metrics.py``
    computes it) and what ``python -m replay summary --json`` and ``verify`` say
    of the log after shutdown (retention deleted its oldest files, so replay starts
    at the oldest remaining snapshot);
  * the server log's WARNING lines by kind (the message up to its first key=value);
  * request latency p50/p99 (and the share of prompt tokens served from cache) in
    every arm, over the whole run, over the span every arm ran (the first
    ``--baseline-minutes``: prompts grow as sessions go on, so only that compares) and,
    for ours, outside the server outage: what the connector costs a user against no
    connector and eager LMCache;
  * what each fault lost: stores failed or dropped around the restart, and the
    abandoned batch with the held-back drops of its request.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from typing import Any

from bench.soak.engine import MEAN_TIMES, SAMPLE_EVERY_S

PACE_MIN_TOKENS = 8  # a request's latency per output token, for requests this long or longer


def slope_per_hour(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MiB) in MiB per hour."""
    if len(points) < 3:
        return None
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx * 3600


def percentile(values: list[float], q: float) -> float | None:
    """Nearest rank."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))]

def figures(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The table's row values of one arm."""
    duration_s = result["minutes"] * 60
    warmup_s = 300.0 if duration_s >= 900 else duration_s / 3
    samples = result.get("samples", [])
    requests = result.get("requests", [])
    lat = [r["latency_s"] for r in requests]
    # The span every arm ran (the baselines' minutes), for a like-for-like latency:
    # a session's prompt grows turn by turn, so a longer run sees longer prompts.
    # Arms that took turns (``--interleave``) all ran the same wall span.
    spans = [m for m in (args.minutes, args.baseline_minutes) if m > 0]
    span_s = result.get("turns_wall_s") or (min(spans) * 60 if spans else duration_s)
    common = [r["latency_s"] for r in requests if r["t"] + r["latency_s"] <= span_s]
    # Requests that overlap the server's outage, from the kill to 15 s after it is
    # healthy again (the adapters' heartbeat has noticed by then).
    restart = result.get("faults", {}).get("server_restart")
    window = ((restart["killed_at_s"], restart["healthy_at_s"] + 15.0) if restart
              else None)
    calm = [r["latency_s"] for r in requests if window is None
            or r["t"] >= window[1] or r["t"] + r["latency_s"] <= window[0]]
    prompt = sum(r["prompt_tokens"] for r in requests)
    cached = sum(r["cached_tokens"] for r in requests)

    def series(key: str) -> list[tuple[float, float]]:
        return [(s["t"], s[key]) for s in samples if s.get(key) is not None]

    def rss(key: str) -> dict[str, Any]:
        points = series(key)
        if not points:
            return {}
        warm = [p for p in points if p[0] >= warmup_s]
        return {"first": points[0][1], "at_warmup": warm[0][1] if warm else None,
                "end": points[-1][1], "max": max(v for _, v in points),
                "slope_mib_per_h": slope_per_hour(warm)}

    out: dict[str, Any] = {
        "warmup_s": warmup_s, "requests": len(requests), "sessions": result.get("sessions"),
        "errors": sum(result.get("errors", {}).values()),
        # over the arm's own turns when the arms took turns
        "requests_per_s": (len(requests) / (result["minutes"] * 60 if result.get("turns_wall_s")
                                            else result["traffic_s"])
                           if result.get("traffic_s") else None),
        "latency_p50_s": percentile(lat, 0.50), "latency_p99_s": percentile(lat, 0.99),
        "latency_max_s": max(lat) if lat else None,
        "common_span_s": span_s,
        "latency_common_p50_s": percentile(common, 0.50),
        "latency_common_p99_s": percentile(common, 0.99),
        "latency_outside_faults_p50_s": percentile(calm, 0.50),
        "latency_outside_faults_p99_s": percentile(calm, 0.99),
        "latency_outside_faults_max_s": max(calm) if calm else None,
        "fault_window_s": window,
        "prompt_tokens": prompt, "cached_share": cached / prompt if prompt else None,
        "engine_rss": rss("engine_rss_mib"), "recorder_rss": rss("recorder_rss_mib"),
        "api_rss": rss("api_rss_mib"),
    }
    end = result.get("end", {})
    queries = end.get("external_prefix_cache_queries") or 0
    out["external_hit_share"] = (end.get("external_prefix_cache_hits", 0) / queries
                                 if queries else None)
    out["preemptions"] = end.get("preemptions")
    paces = [r["latency_s"] / r["completion_tokens"] for r in requests
             if r.get("completion_tokens", 0) >= PACE_MIN_TOKENS]
    out["pace_p50_ms"] = None if not paces else (percentile(paces, 0.50) or 0.0) * 1e3
    steps = end.get("engine_steps")
    out["steps_per_request"] = steps / len(requests) if steps and requests else None
    out["tokens_per_step"] = end.get("step_tokens", 0) / steps if steps else None
    for name in MEAN_TIMES:
        out[f"mean_{name}"] = end.get(f"mean_{name}")
    if result["arm"].startswith("ours"):
        out["pinned_end"] = end.get("pinned_blocks")
        out["in_flight_end"] = end.get("in_flight_batches")
    if result["arm"] == "ours":
        sizes = [s["log_dir_mib"] for s in samples if "log_dir_mib" in s]
        out["log_dir_max_mib"] = max(sizes) if sizes else None
        out["log_dir_bound_mib"] = args.log_max_total_mib
        out["log_dir_over_bound_samples"] = sum(1 for v in sizes if v > args.log_max_total_mib)
        out["ledger_closes_scrape"] = all(
            e["closes"] for unit in ("ledger_ops", "ledger_tokens")
            for e in end.get(unit, {}).values()) and bool(end.get("ledger_ops"))
        summary = result.get("replay_summary", {})
        data = summary.get("json") or {}
        if "runs" in data:
            out["ledger_closes_replay"] = data.get("total", {}).get("ledger_closes")
        else:
            out["ledger_closes_replay"] = data.get("ledger_closes")
        out["replay_summary_rc"] = summary.get("rc")
        out["replay_verify_rc"] = result.get("replay_verify", {}).get("rc")
        out["log_ended_cleanly"] = "no END record" not in result.get(
            "replay_verify", {}).get("stdout", "")
    return out


# -- the report ---------------------------------------------------------------------

def _f(value: Any, fmt: str = "{:.2f}") -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):
        return ", ".join(f"e{k} {_f(v, '{:g}')}" for k, v in value.items()) or "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float | int):
        return fmt.format(value)
    return str(value)


def report(results: list[dict[str, Any]]) -> str:
    lines: list[str] = []
    arms = [r for r in results if "figures" in r]
    head = "| | " + " | ".join(f"{r['name']} ({r['minutes']:g} min)" for r in arms) + " |"
    lines += [head, "|---" * (len(arms) + 1) + "|"]

    def row(label: str, get: Any) -> None:
        lines.append(f"| {label} | " + " | ".join(get(r) for r in arms) + " |")

    def fig(r: dict[str, Any]) -> dict[str, Any]:
        values: dict[str, Any] = r["figures"]
        return values

    row("requests (sessions), errors", lambda r: f"{fig(r)['requests']} ({fig(r)['sessions']}), "
        f"{fig(r)['errors']}")
    row("requests/s", lambda r: _f(fig(r)["requests_per_s"]))
    row("latency p50 / p99 / max s, whole run", lambda r: f"{_f(fig(r)['latency_p50_s'])} / "
        f"{_f(fig(r)['latency_p99_s'])} / {_f(fig(r)['latency_max_s'])}")
    row("latency p50 / p99 s, first {:g} min (every arm's span)".format(
        arms[0]["figures"]["common_span_s"] / 60 if arms else 0),
        lambda r: f"{_f(fig(r)['latency_common_p50_s'])} / {_f(fig(r)['latency_common_p99_s'])}")
    if any(fig(r)["fault_window_s"] for r in arms):
        row("latency p50 / p99 / max s, outside the server outage",
            lambda r: "-" if not fig(r)["fault_window_s"] else
            f"{_f(fig(r)['latency_outside_faults_p50_s'])} / "
            f"{_f(fig(r)['latency_outside_faults_p99_s'])} / "
            f"{_f(fig(r)['latency_outside_faults_max_s'])}")
    row("prompt tokens from cache (any tier)", lambda r: _f(fig(r)["cached_share"], "{:.1%}"))
    row("LMCache hit share of external queries",
        lambda r: _f(fig(r)["external_hit_share"], "{:.1%}"))
    row("preemptions", lambda r: _f(fig(r)["preemptions"], "{:.0f}"))
    row(f"request latency per output token, p50 ms (requests of {PACE_MIN_TOKENS}+ tokens)",
        lambda r: _f(fig(r)["pace_p50_ms"], "{:.1f}"))
    row("engine steps per request, tokens per step (whole server life)",
        lambda r: f"{_f(fig(r)['steps_per_request'], '{:.1f}')}, "
        f"{_f(fig(r)['tokens_per_step'], '{:.1f}')}")
    row("mean ms: queued / prefill / decode / first token / LMCache lookup",
        lambda r: " / ".join(_f(None if fig(r)[f"mean_{k}"] is None
                                else fig(r)[f"mean_{k}"] * 1e3, "{:.0f}") for k in MEAN_TIMES))
    for key, label in (("engine_rss", "engine core"), ("recorder_rss", "recorder")):
        row(f"{label} RSS MiB: first / after warm-up / end / max",
            lambda r, k=key: "-" if not fig(r)[k] else
            f"{_f(fig(r)[k]['first'], '{:.0f}')} / {_f(fig(r)[k]['at_warmup'], '{:.0f}')} / "
            f"{_f(fig(r)[k]['end'], '{:.0f}')} / {_f(fig(r)[k]['max'], '{:.0f}')}")
        row(f"{label} RSS slope after warm-up, MiB/h",
            lambda r, k=key: _f((fig(r)[k] or {}).get("slope_mib_per_h"), "{:+.1f}"))
    ours = [r for r in arms if r["arm"] == "ours"]
    if ours:
        row("log dir max MiB (bound)", lambda r: "-" if r["arm"] != "ours" else
            f"{_f(fig(r)['log_dir_max_mib'])} ({fig(r)['log_dir_bound_mib']:g}); files "
            f"{r.get('log_files_seen')} seen, {r.get('log_files_end')} at the end")
        row("pinned blocks / in-flight batches at the end",
            lambda r: "-" if not r["arm"].startswith("ours") else
            f"{_f(fig(r)['pinned_end'])} / {_f(fig(r)['in_flight_end'])}")
        row("ledger closes: scrape / replay summary (rc)",
            lambda r: "-" if r["arm"] != "ours" else
            f"{_f(fig(r)['ledger_closes_scrape'])} / {_f(fig(r)['ledger_closes_replay'])} "
            f"({fig(r)['replay_summary_rc']})")
        row("replay verify: rc, the log's END", lambda r: "-" if r["arm"] != "ours" else
            f"{fig(r)['replay_verify_rc']}, "
            f"{'written' if fig(r)['log_ended_cleanly'] else 'missing (no END record)'}")
        row("vLLM's shutdown (SIGTERM to exit), s", lambda r: _f(r.get("shutdown_s"), "{:.1f}"))
    lines.append("")
    lines.append("RSS over time (MiB; engine core / recorder):")
    lines.append("")
    lines += rss_table(arms)
    if any(r.get("cpu_s") for r in arms):
        lines.append("")
        lines.append("CPU seconds per 100 requests during the traffic, by process and by "
                     "engine-core thread (bench.soak.cpu; with --interleave the other arms' "
                     "turns are in the span too):")
        lines.append("")
        lines += cpu_table(arms)
    lines.append("")
    lines.append("WARNING/ERROR lines by kind (the server log):")
    lines.append("")
    lines.append("| arm | level | count | kind |")
    lines.append("|---|---|---|---|")
    for r in arms:
        for level in ("ERROR", "WARNING"):
            for kind, n in r.get("warnings", {}).get(level, {}).items():
                lines.append(f"| {r['name']} | {level} | {n} | `{kind}` |")
    for r in ours:
        lines.append("")
        lines += fault_report(r)
    return "\n".join(lines)


def rss_table(arms: list[dict[str, Any]]) -> list[str]:
    longest = max((r["minutes"] for r in arms), default=0) * 60
    step = 300.0 if longest >= 1200 else 30.0
    marks = [i * step for i in range(int(longest // step) + 1)]
    lines = ["| t | " + " | ".join(r["name"] for r in arms) + " |",
             "|---" * (len(arms) + 1) + "|"]
    for mark in marks:
        cells = []
        for r in arms:
            near = [s for s in r.get("samples", []) if abs(s["t"] - mark) <= SAMPLE_EVERY_S / 2
                    or (mark == marks[-1] and s is r["samples"][-1])]
            if not near or mark > r["minutes"] * 60 + SAMPLE_EVERY_S:
                cells.append("")
                continue
            s = near[0]
            rec = s.get("recorder_rss_mib")
            cells.append(f"{_f(s.get('engine_rss_mib'), '{:.0f}')}"
                         + (f" / {rec:.0f}" if rec is not None else ""))
        lines.append(f"| {mark / 60:g} min | " + " | ".join(cells) + " |")
    return lines


def cpu_table(arms: list[dict[str, Any]], threads_shown: int = 8) -> list[str]:
    """Rows of CPU seconds per 100 requests: each process role, then the engine
    core's busiest threads (by the most any arm spent in them)."""
    def per_100(r: dict[str, Any], key: str, name: str) -> str:
        seconds = (r.get("cpu_s") or {}).get(key, {}).get(name)
        count = r["figures"]["requests"]
        return "-" if seconds is None or not count else f"{seconds * 100 / count:.2f}"

    lines = ["| | " + " | ".join(r["name"] for r in arms) + " |",
             "|---" * (len(arms) + 1) + "|"]
    for role in ("api", "engine", "workers", "other", "recorder", "lmcache"):
        if any(role in (r.get("cpu_s") or {}).get("roles", {}) for r in arms):
            lines.append(f"| {role} | " + " | ".join(per_100(r, "roles", role)
                                                    for r in arms) + " |")
    busiest: dict[str, float] = {}
    for r in arms:
        for name, seconds in (r.get("cpu_s") or {}).get("engine_threads", {}).items():
            busiest[name] = max(busiest.get(name, 0.0), seconds)
    for name in sorted(busiest, key=busiest.__getitem__, reverse=True)[:threads_shown]:
        lines.append(f"| engine thread `{name}` | " + " | ".join(
            per_100(r, "engine_threads", name) for r in arms) + " |")
    return lines


def fault_report(r: dict[str, Any]) -> list[str]:
    lines = []
    restart = r.get("faults", {}).get("server_restart")
    if restart:
        d = restart["delta"]
        lines.append(
            f"Fault 1, LMCache server SIGKILLed and restarted on the same ports "
            f"(down {restart['down_s']} s; counters from just before to "
            f"{restart['window_s']} s after the kill): "
            f"failed_ops +{d.get('failed_ops_total', 0):g} "
            f"({d.get('failed_tokens_total', 0):g} tokens), "
            f"dropped store_failed +{d.get('dropped_ops_total{cause=store_failed}', 0):g} ops, "
            f"stored +{d.get('stored_ops_total', 0):g}, forgotten chunks "
            f"+{d.get('forgotten_chunks_total', 0):g}; server objects "
            f"{restart['objects_before_kill']} before, {restart['objects_60s_after_restart']} "
            f"60 s after the restart. Full delta: `{json.dumps(d)}`. Log lines in the window:")
        for level, kinds in restart["log_lines"].items():
            for kind, n in kinds.items():
                lines.append(f"  * {level} x{n}: `{kind}`")
    lost = r.get("faults", {}).get("lost_receipt")
    if lost:
        d = lost["delta"]
        fired = lost["hook_fired"]
        fields = lost["abandoned_fields"]
        lines.append("")
        lines.append(
            f"Fault 2, one store receipt lost in the engine core: hook "
            f"{'fired: ' + json.dumps(fired) if fired else 'DID NOT FIRE'}; "
            f"abandoned: {'yes' if lost['abandoned_lines'] else 'NO'} "
            f"({'the same request' if lost['same_request'] else 'not matched'}; "
            f"ops={fields.get('ops')} waited_s={fields.get('waited_s')} "
            f"held_back_ops_dropped={fields.get('held_back_ops_dropped')}); "
            f"abandoned_batches +{d.get('abandoned_batches_total', 0):g}, abandoned_ops "
            f"+{d.get('abandoned_ops_total', 0):g} "
            f"({d.get('abandoned_tokens_total', 0):g} tokens), dropped store_failed "
            f"+{d.get('dropped_ops_total{cause=store_failed}', 0):g} in the window.")
    return lines
