"""``replay verify``, and how every command reports a replay's problems.

Contract: :func:`verify_runs` replays each run a command covers (on worker
processes unless ``--workers 1``: ``replay.parallel``) and prints, per run,
what was replayed, where it started, the divergence or rejection, and
``OK`` when every outcome and digest matches, or one JSON document; with
several runs, a line per run and the total. Its exit code is the worst of
the runs': 1 for a divergence or a rejected event, 3 for damage or a lost
event, else 0. :func:`problems`, :func:`report_damage` and
:func:`warn_rejected` are the damage and rejection lines the analyses
(explain, requests, summary, whatif, timeline) print the same way.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, TextIO

from replay.brief import brief
from replay.parallel import replay_parallel
from replay.runner import ReplayResult, replay
from replay.text import DETAIL_CHARS_MAX, field
from replay.usage import EXIT_CORRUPT, EXIT_DIVERGED, EXIT_OK

__all__ = ["problems", "report_damage", "verify_json", "verify_run", "verify_runs",
           "warn_rejected"]


def problems(result: ReplayResult) -> list[str]:
    out = [damage.describe() for damage in result.damage]
    out += result.lost
    if result.header is None:
        out.append("no header record: nothing to replay")
    return out


def report_damage(result: ReplayResult, err: TextIO) -> int:
    found = problems(result)
    for problem in found:
        print(f"damage: {field(problem, DETAIL_CHARS_MAX)}", file=err)
    return EXIT_CORRUPT if found else EXIT_OK


def warn_rejected(result: ReplayResult, err: TextIO) -> None:
    """For the analyses: they cover the events before a rejection."""
    if result.rejection is not None:
        print(f"warning: {field(result.rejection.describe(), DETAIL_CHARS_MAX)}; the core "
              "stopped there, and so does this analysis", file=err)


def verify_json(result: ReplayResult, code: int) -> dict[str, Any]:
    divergence = result.divergence
    rejection = result.rejection
    return {
        "ok": code == EXIT_OK,
        "engine_index": result.header.engine_index if result.header is not None else None,
        "events_applied": result.events_applied,
        "records": result.records,
        "digests_checked": result.digests_checked,
        "snapshots_checked": result.snapshots_checked,
        "first_seq": result.first_seq,
        "snapshots_loaded": result.snapshots_loaded,
        "ended_cleanly": result.ended_cleanly,
        "vanished": result.vanished,
        "divergence": None if divergence is None else {
            "seq": divergence.seq, "kind": divergence.kind,
            "event": repr(divergence.event), "expected": repr(divergence.expected),
            "got": repr(divergence.got), "detail": divergence.detail,
        },
        "rejection": None if rejection is None else {
            "seq": rejection.seq, "event": repr(rejection.event),
            "recorded_reason": rejection.recorded_reason,
            "reproduced": rejection.reproduced,
            "reproduced_reason": rejection.reproduced_reason,
        },
        "problems": problems(result),
        "stopped": result.stopped,
    }



def verify_runs(args: argparse.Namespace, runs: list[str | None], out: TextIO, err: TextIO
                ) -> int:
    """Every run of the log, each as :func:`verify_run` reports it; with
    several, a line per run and the total."""
    if len(runs) == 1:
        return verify_run(args, runs[0], out, err)[0]
    codes, results = {}, {}
    for prefix in runs:
        assert prefix is not None
        if not args.json:
            print(f"== run {prefix}", file=out)
        codes[prefix], results[prefix] = verify_run(args, prefix, out, err,
                                                     json_out=False if args.json else None)
    code = max(codes.values())
    events = sum(result.events_applied for result in results.values())
    if args.json:
        json.dump({"ok": code == EXIT_OK, "events_applied": events,
                   "runs": {prefix: verify_json(results[prefix], codes[prefix])
                            for prefix in runs if prefix is not None}}, out, indent=2)
        out.write("\n")
        return code
    engines = sorted({result.header.engine_index for result in results.values()
                      if result.header is not None})
    print(f"== total: {len(runs)} runs (engines {', '.join(map(str, engines))}), {events} "
          f"events replayed, {sum(c == EXIT_OK for c in codes.values())} of {len(runs)} OK",
          file=out)
    return code


def verify_run(args: argparse.Namespace, prefix: str | None, out: TextIO, err: TextIO,
                json_out: bool | None = None) -> tuple[int, ReplayResult]:
    result = (replay(args.log, prefix=prefix, check_snapshots=args.snapshots)
              if args.workers == 1 else
              replay_parallel(args.log, prefix=prefix, workers=args.workers,
                              check_snapshots=args.snapshots))
    divergence = result.divergence
    rejection = result.rejection
    code = EXIT_DIVERGED if divergence is not None or rejection is not None else (
        EXIT_CORRUPT if problems(result) else EXIT_OK)
    if json_out is False:
        return code, result
    if args.json:
        json.dump(verify_json(result, code), out, indent=2)
        out.write("\n")
        return code, result
    if result.header is not None:
        header = result.header
        print(f"engine {header.engine_index}, {header.policy}, world size {header.world_size}",
              file=out)
    print(f"{result.events_applied} events replayed from {result.records} records, "
          f"{result.digests_checked} digests checked"
          + (", clean end" if result.ended_cleanly else
             ", no END record" if not result.vanished else ""), file=out)
    if result.vanished:
        print(result.vanished, file=out)
    for seq in result.snapshots_loaded:
        print(f"started from the snapshot before event {seq}"
              + (" (the files before it are missing)" if seq == result.first_seq else
                 " (after the loss above)"), file=out)
    if divergence is not None:
        print(f"DIVERGED at seq {divergence.seq} ({divergence.kind}): "
              f"{field(divergence.detail, DETAIL_CHARS_MAX)}", file=out)
        event = "-" if divergence.event is None else brief(divergence.event)
        print(f"  event:    {field(event, DETAIL_CHARS_MAX)}", file=out)
        print(f"  expected: {field(divergence.expected, DETAIL_CHARS_MAX)}", file=out)
        print(f"  got:      {field(divergence.got, DETAIL_CHARS_MAX)}", file=out)
    if rejection is not None:
        print(f"rejected: {field(rejection.describe(), DETAIL_CHARS_MAX)}", file=out)
    for problem in problems(result):
        print(f"damage: {field(problem, DETAIL_CHARS_MAX)}", file=err)
    if result.stopped and divergence is None and (rejection is None
                                                  or rejection.reproduced is None):
        print(f"replay stopped early: {result.stopped}", file=out)
    if code == EXIT_OK:
        print("OK: every outcome and digest matches", file=out)
    return code, result

