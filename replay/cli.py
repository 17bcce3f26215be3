"""``lazy-offload-replay`` / ``python -m replay``: verify, explain, summarise,
what-if, diff and plot recorded runs, or tail a live one.

Exit codes: 0 ok; 1 divergence or a rejected event (verify), a ledger that
does not close (summary), two logs that part (diff), or no record before the
timeout (tail); 2 usage error (bad arguments, no such log, an unknown request
id or a step outside the log, a path where tail needs an endpoint); 3
corruption (a damaged record, a lost event, no header; or the memory ceiling
reached, see --max-memory-mib). Damage is reported on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO, cast

from logfiles.runs import NoRun, run_prefixes
from replay import diff as diff_mod
from replay import explain as explain_mod
from replay import explain_text, memory, seek, verify
from replay import requests as requests_mod
from replay import step as step_mod
from replay import summary as summary_mod
from replay import timeline as timeline_mod
from replay import whatif as whatif_mod
from replay.runner import config_of, replay, spaced_collections
from replay.text import DETAIL_CHARS_MAX, SafeWriter, field
from replay.usage import EXIT_CORRUPT, EXIT_DIVERGED, EXIT_OK, EXIT_USAGE, UsageError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lazy-offload-replay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-memory-mib", type=_mib, metavar="MIB",
                        help="the memory ceiling replay sets for itself, per process "
                             f"(default: ${memory.ENV_VAR}, else half the machine's or "
                             f"container's memory, at most {memory.DEFAULT_MAX_MIB}; 0: none); "
                             "reaching it exits 3")
    sub = parser.add_subparsers(dest="command", required=True)

    def log_command(name: str, help_text: str, *, json_flag: bool = True
                    ) -> argparse.ArgumentParser:
        command = sub.add_parser(name, help=help_text)
        command.add_argument("log", help="a .lolog file or a directory of one run")
        command.add_argument("--prefix", help="which run, when a directory holds several")
        if json_flag:
            command.add_argument("--json", action="store_true", help="machine-readable output")
        return command

    command = log_command("verify", "re-run the core and compare every outcome and digest")
    command.add_argument("--workers", type=int, default=1,
                         help="replay the run's files on N processes (0: one per core); each "
                              "file starts from its own snapshot, the seams are checked")
    command.add_argument("--snapshots", action="store_true",
                         help="also rebuild every snapshot folding passes and check its digest "
                              "(by default only the folded state's digest is compared with it)")
    command = log_command("explain", "the story of one request's store ops, or of one "
                                     "token step; starts from the nearest snapshot the "
                                     "log's index allows")
    which = command.add_mutually_exclusive_group(required=True)
    which.add_argument("--request", help="request id, or a prefix of one that no other id "
                                         "starts (`replay requests LOG` lists them)")
    which.add_argument("--at", type=int, metavar="STEP",
                       help="a token step (state.step_index, as explain prints it)")
    command.add_argument("--no-index", action="store_true",
                         help="replay from the beginning (the index is not used)")
    command.add_argument("--tokens", help="only ops overlapping START:END")
    command.add_argument("--verbose", action="store_true",
                         help="print every block id (default: count and ranges)")
    command = log_command("requests", "every request with its outcome: ops stored, dropped "
                                      "(by cause), pending; the tokens it lost")
    command.add_argument("--cause", action="append", default=[], metavar="CAUSE",
                         help="only requests with an op dropped for CAUSE (evicted, stale, "
                              "cache_reset, duplicate, ...) or in that status (stored, "
                              "rejected, buffered, ...); repeatable")
    command = log_command("summary", "ledger, drop causes, deferral, pinned blocks")
    command.add_argument("--top", type=int, default=10, help="requests listed by loss")
    command = log_command("whatif", "re-run the observations under another policy/knobs")
    command.add_argument("--policy", choices=("FIFO", "EVICTION_AWARE"))
    command.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                         help="a config knob, e.g. max_drain_per_step=32 (repeatable)")
    command.add_argument("--out", metavar="DIR",
                         help="also write the what-if re-run as a log in DIR/whatif and the "
                              "re-simulated original in DIR/original (for diff)")
    command = sub.add_parser("diff", help="the first event where two logs part, and their "
                                          "final counters")
    command.add_argument("log_a", help="a .lolog file or a directory of one run")
    command.add_argument("log_b", help="the other log")
    command.add_argument("--prefix-a", help="which run of log_a")
    command.add_argument("--prefix-b", help="which run of log_b")
    command.add_argument("--full", action="store_true",
                         help="walk every event from 0 instead of bisecting by digests")
    command.add_argument("--no-ledgers", action="store_true",
                         help="skip the final counters (saves a replay of each last file)")
    command.add_argument("--json", action="store_true", help="machine-readable output")
    command = log_command("timeline", "plot the run per step: pool, ops, per-request lanes "
                                      "(needs the 'plot' extra: plotly)", json_flag=False)
    command.add_argument("-o", "--output", required=True,
                         help="FILE.html (interactive, plotly.js embedded: opens offline)")
    command.add_argument("--lanes", type=int, default=40,
                         help="lanes for the N requests with the most store ops (default 40)")
    command.add_argument("--requests", help="ID,ID,...: lanes for these requests instead")
    command = sub.add_parser("tail", help="follow a live event stream (ZeroMQ SUB)")
    command.add_argument("endpoint", nargs="+",
                         help="e.g. tcp://127.0.0.1:5600 (several: one per engine)")
    command.add_argument("--count", type=int, default=0, help="stop after N records")
    command.add_argument("--timeout", type=float, default=0.0,
                         help="stop after S seconds without a record")
    return parser


def _mib(text: str) -> int:
    try:
        return memory.parse_mib(text, "--max-memory-mib")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _run_bounded(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """The command under the memory ceiling (``replay.memory``); reaching it
    is an error message and exit 3, not a traceback."""
    try:
        mib = memory.ceiling_mib(args.max_memory_mib)
    except ValueError as error:
        raise UsageError(str(error)) from None
    with memory.memory_ceiling(mib) as ceiling:
        try:
            with spaced_collections():
                return int(_COMMANDS[args.command](args, out, err))
        except MemoryError:
            pass  # reported below, with the ceiling lifted
    where = f"replay's ceiling of {ceiling} MiB" if ceiling else "no ceiling replay set"
    print(f"error: out of memory under {where}: the log needs more than that (a hostile "
          "or damaged log, or a bigger run than the ceiling allows: set --max-memory-mib "
          f"or ${memory.ENV_VAR}; 0: none)", file=err)
    return EXIT_CORRUPT


def _tokens(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    start, sep, end = text.partition(":")
    try:
        lo, hi = int(start), int(end)
    except ValueError:
        raise UsageError(f"--tokens {text!r}: expected START:END") from None
    if not sep or lo >= hi:
        raise UsageError(f"--tokens {text!r}: expected START:END with START < END")
    return lo, hi


def _runs(args: argparse.Namespace) -> list[str | None]:
    """The runs a command covers: the one ``--prefix`` names, or every run of
    the directory (several engines may share it)."""
    return [args.prefix] if args.prefix is not None else run_prefixes(args.log)


def _verify(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    if args.workers < 0:
        raise UsageError("--workers must be >= 0")
    return verify.verify_runs(args, _runs(args), out, err)


def _explain(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    tokens = _tokens(args.tokens)
    notes: list[str] = []
    if args.at is not None:
        if args.at < 0:
            raise UsageError(f"--at {args.at}: expected a token step >= 0")
        steps = step_mod.StepObserver(args.at, verbose=args.verbose)
        result = (replay(args.log, prefix=args.prefix, observer=steps) if args.no_index else
                  seek.replay_at_step(args.log, args.prefix, args.at, steps, notes))
        data = steps.to_json()
        if not data["found"] and result.state is not None and not verify.problems(result):
            raise UsageError(f"--at {args.at}: the log's token steps are 0 to "
                             f"{result.state.step_index}")
        text = explain_text.format_step(data)
    else:
        if args.prefix is not None:
            prefix, req_id = args.prefix, requests_mod.resolve(
                requests_mod.request_ids(args.log, args.prefix), args.request,
                f"run {args.prefix} of {args.log}", f"{args.log} --prefix {args.prefix}")
        else:
            prefix, req_id = requests_mod.run_holding(args.log, args.request)
        if req_id != args.request:
            notes.append(f"request {field(args.request)} is {field(req_id)}")
        if prefix is not None and args.prefix is None:
            notes.append(f"{field(req_id)} is in run {field(prefix)} (--prefix {field(prefix)})")
        observer = explain_mod.ExplainObserver(req_id, verbose=args.verbose)
        result = (replay(args.log, prefix=prefix, observer=observer) if args.no_index
                  else seek.explain_request(args.log, prefix, req_id, observer, notes))
        data = observer.to_json(tokens)
        text = explain_text.format_story(data, args.verbose)
    if args.json:
        json.dump(data, out, indent=2, default=list)
        out.write("\n")
    else:
        print(text, file=out)
    code = verify.report_damage(result, err)
    for note in notes:
        print(f"note: {note}", file=err)
    verify.warn_rejected(result, err)
    if result.divergence is not None:
        print(f"warning: replay diverged at seq {result.divergence.seq}; the story stops "
              "there", file=err)
        code = code or EXIT_DIVERGED
    return code


def _requests(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Every request of each run with its outcome (``replay.requests``)."""
    runs = _runs(args)
    code = EXIT_OK
    listing: dict[str, list[dict[str, Any]]] = {}
    for prefix in runs:
        observer = requests_mod.OutcomeObserver()
        result = replay(args.log, prefix=prefix, observer=observer)
        rows = [row for row in requests_mod.outcomes(observer)
                if not args.cause or requests_mod.row_causes(row) & set(args.cause)]
        listing[prefix or ""] = rows
        if not args.json:
            if len(runs) > 1:
                print(f"== run {prefix}", file=out)
            width = min(max((len(row["req_id"]) for row in rows), default=0), 40)
            for row in rows:
                print(requests_mod.format_row(row, width), file=out)
            print(f"{len(rows)} requests" + (f" with {' or '.join(args.cause)}"
                                             if args.cause else ""), file=out)
        code = max(code, verify.report_damage(result, err))
        verify.warn_rejected(result, err)
    if args.json:
        json.dump(listing if len(runs) > 1 else listing[""], out, indent=2)
        out.write("\n")
    return code


def _summary(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """The summary of each run (per engine, when several share the directory)
    and, with several, their ledgers added up."""
    runs = _runs(args)
    if len(runs) == 1:
        return _summary_run(args, runs[0], out, err)[0]
    codes, totals = [], {"admitted": 0, "stored": 0, "pending": 0}
    closes = True
    datas = {}
    for prefix in runs:
        if not args.json:
            print(f"== run {prefix}", file=out)
        code, data = _summary_run(args, prefix, out, err, quiet_json=args.json)
        codes.append(code)
        if data is not None:
            datas[prefix] = data
            ops = data["ledger"]["ops"]
            for key in totals:
                totals[key] += int(ops.get(key, 0))
            closes = closes and bool(data["ledger_closes"])
    if args.json:
        json.dump({"runs": datas, "total": {"ops": totals, "ledger_closes": closes}}, out,
                  indent=2)
        out.write("\n")
    else:
        print(f"== total: {len(runs)} runs: {totals['admitted']} ops admitted, "
              f"{totals['stored']} stored, {totals['pending']} pending; ledger closes: "
              f"{'yes' if closes else 'NO'}", file=out)
    return max(codes)


def _summary_run(args: argparse.Namespace, prefix: str | None, out: TextIO, err: TextIO,
                 quiet_json: bool = False) -> tuple[int, dict[str, Any] | None]:
    observer = summary_mod.SummaryObserver()
    result = replay(args.log, prefix=prefix, observer=observer)
    if result.state is None:
        return verify.report_damage(result, err) or EXIT_CORRUPT, None
    data = summary_mod.summarize(result.state, observer, top=args.top)
    if quiet_json:
        code = verify.report_damage(result, err)
        verify.warn_rejected(result, err)
        return (EXIT_DIVERGED if not data["ledger_closes"] else code), data
    if args.json:
        json.dump(data, out, indent=2)
        out.write("\n")
    else:
        print(summary_mod.format_summary(data, args.log, prefix), file=out)
    code = verify.report_damage(result, err)
    verify.warn_rejected(result, err)
    if not data["ledger_closes"]:
        return EXIT_DIVERGED, data
    return code, data


def _whatif(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    header, events, problems = whatif_mod.load_observations(args.log, args.prefix)
    try:
        config = whatif_mod.override(header, args.policy, args.set)
    except ValueError as error:
        raise UsageError(str(error)) from None
    original = config_of(header)
    observer = summary_mod.SummaryObserver()
    result = replay(args.log, prefix=args.prefix, observer=observer)
    assert result.state is not None
    verify.warn_rejected(result, err)
    recorded = summary_mod.summarize(result.state, observer)
    try:
        resim = whatif_mod.simulate(original, header.world_size, events,
                                    out=_out(args.out, "original"), prefix="original")
        whatif = whatif_mod.simulate(config, header.world_size, events,
                                     out=_out(args.out, "whatif"), prefix="whatif")
    except FileExistsError as error:
        raise UsageError(f"--out {args.out}: {error.filename} exists; pick another directory "
                         "(a what-if never overwrites a log)") from None
    except OSError as error:
        raise UsageError(f"--out {args.out}: {error.strerror}") from None
    rows = whatif_mod.compare(recorded, resim, whatif)
    if args.json:
        json.dump({"original": whatif_mod.describe(original),
                   "whatif": whatif_mod.describe(config),
                   "recorded": recorded, "resimulated_original": resim, "whatif_result": whatif,
                   "caveat": whatif_mod.CAVEAT, "problems": problems}, out, indent=2)
        out.write("\n")
    else:
        print(f"original: {whatif_mod.describe(original)}", file=out)
        print(f"what-if:  {whatif_mod.describe(config)}", file=out)
        print(whatif_mod.format_rows(rows, original.policy.value, config.policy.value),
              file=out)
        for name, sim in (("re-sim", resim), ("what-if", whatif)):
            est = sim["estimate"]
            print(f"{name} estimate: {est['reallocation_conflicts']} reallocation conflicts, "
                  f"{est['window_blocks_padded']} unknown window blocks padded"
                  + (f"; {est['error']}" if est["error"] else ""), file=out)
        print(whatif_mod.CAVEAT, file=out)
    if args.out is not None:
        original_dir, whatif_dir = _out(args.out, "original"), _out(args.out, "whatif")
        print(f"wrote the re-simulated original to {original_dir} and the what-if to "
              f"{whatif_dir}; compare them: replay diff {original_dir} {whatif_dir}",
              file=err if args.json else out)
    for problem in problems:
        print(f"damage: {field(problem, DETAIL_CHARS_MAX)}", file=err)
    return EXIT_CORRUPT if problems else EXIT_OK


def _out(directory: str | None, name: str) -> str | None:
    return None if directory is None else str(Path(directory) / name)


def _diff(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    result = diff_mod.diff_logs(args.log_a, args.log_b, prefix_a=args.prefix_a,
                                prefix_b=args.prefix_b, full=args.full,
                                ledgers=not args.no_ledgers)
    if args.json:
        json.dump(diff_mod.to_json(result), out, indent=2)
        out.write("\n")
    else:
        print(diff_mod.format_diff(result, args.log_a, args.log_b), file=out)
    for problem in result.damage:
        print(f"damage: {field(problem, DETAIL_CHARS_MAX)}", file=err)
    if result.damage:
        return EXIT_CORRUPT
    return EXIT_OK if result.identical else EXIT_DIVERGED


def _timeline(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from replay import timeline_plot

    try:
        timeline_plot.check_target(args.output)
        timeline_plot.require_plotly()
        requests = [r for r in (args.requests or "").split(",") if r]
        timeline, result = timeline_mod.build_timeline(
            args.log, prefix=args.prefix, max_lanes=args.lanes, requests=requests)
        title = f"{args.log}: {timeline.token_steps} token steps"
        if result.header is not None:
            title += f", {result.header.policy}"
        timeline_plot.write_html(timeline, args.output, title)
    except (timeline_plot.MissingDependency, ValueError) as error:
        raise UsageError(str(error)) from None
    except OSError as error:
        raise UsageError(f"-o {args.output}: {error.strerror}") from None
    print(f"wrote {args.output} ({timeline.token_steps} token steps in {len(timeline.steps)} "
          f"points; {timeline_plot.lanes_note(timeline)})", file=out)
    verify.warn_rejected(result, err)
    return verify.report_damage(result, err)


def _tail(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """Exit 0 once records came; 1 when the time ran out before any did."""
    from replay.tail import NotAnEndpoint, follow

    def emit(line: str) -> None:
        print(line, file=out, flush=True)

    try:
        result = follow(args.endpoint, emit, max_records=args.count, timeout_s=args.timeout)
    except NotAnEndpoint as error:
        raise UsageError(str(error)) from None
    if result.records == 0:
        print("error: no record arrived" + ("" if result.connected else
                                            "; nothing listened at the endpoint"), file=err)
        return EXIT_DIVERGED
    return EXIT_OK


_COMMANDS: dict[str, Any] = {
    "verify": _verify, "explain": _explain, "requests": _requests, "summary": _summary,
    "whatif": _whatif,
    "timeline": _timeline, "tail": _tail, "diff": _diff,
}


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None,
         err: TextIO | None = None) -> int:
    out = cast(TextIO, SafeWriter(out if out is not None else sys.stdout))
    err = cast(TextIO, SafeWriter(err if err is not None else sys.stderr))
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code) if isinstance(exit_.code, int) else EXIT_USAGE
    try:
        return _run_bounded(args, out, err)
    except (UsageError, NoRun) as error:
        print(f"error: {field(error, DETAIL_CHARS_MAX)}", file=err)
        return EXIT_USAGE
    except ValueError as error:  # e.g. a log without a header for whatif
        print(f"error: {field(error, DETAIL_CHARS_MAX)}", file=err)
        return EXIT_CORRUPT
    except KeyboardInterrupt:
        return EXIT_OK
    except BrokenPipeError:  # the reader left (``| head``): not an error of ours
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
