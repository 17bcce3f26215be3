"""A long production-like run, recorded by the real recorder, and what the
replay tool costs on it (not a timed test).

    .venv/bin/python -m bench.bench_longrun [--steps 360000] [--keep DIR]

Generates ``--steps`` scheduler steps (default one hour at 100 steps/s) of a
decode-heavy serving mix over the fake engine (``offload_fsm.testing.world``):
up to ``--concurrency`` requests run at once; each prefills 1 to 16 chunks
(at most 4 requests prefill per step), then decodes 40 to 600 tokens, one per
step, offering a chunk each time its decode fills one (64 tokens); receipts
come from every worker 1 to 3 steps after a store, 2 % fail. Every callback
goes through ``connector.recorder.recording.EventRecorder`` (64 MiB files, each after
the first starting with a snapshot, one more every 10,000 events). Then it
prints: bytes per step and per event, ``replay verify`` steps/s on one core
and on every core (``--workers 0``; ``--verify-rounds`` rounds, alternating,
each ``python -m replay verify`` in a fresh process, with the speed-up of each
round and their median), ``explain`` latency for a request near
the end, one early in the run and one token step (``--at``, mid-run), and
``diff`` time for the log against a copy whose outcome check was altered
near the end.
"""

from __future__ import annotations

import argparse
import io
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs
import msgpack

from bench.trees import REPO
from connector.recorder.recording import EventRecorder
from logfiles.runs import run_files
from offload_fsm.log.batch import Deflater, Inflater, encode_batch
from offload_fsm.log.framing import Record, frame, scan
from offload_fsm.log.records import BATCH, HEADER, SNAPSHOT
from offload_fsm.queries import window_depth
from offload_fsm.state import new_state
from offload_fsm.testing.synthetic import RecordingWorld, default_config
from offload_fsm.testing.world import FakePool
from offload_fsm.vocabulary.events import Event, StepScheduled
from offload_fsm.vocabulary.outcome import Outcome
from replay.cli import main as replay_main
from testkit.logedit import rekeyed

VERSIONS = {"package": "bench-longrun", "vllm": "", "lmcache": ""}


@attrs.define(eq=False)
class DecodeWorld(RecordingWorld):
    """The fake engine with decode tokens. ``World.schedule`` reports a step of
    the offered chunks' tokens only; this world adds ``decode_tokens`` (one per
    decoding request, set before each step) to the step it reports, and reads
    the free-queue window at the depth the whole step's tokens give."""

    decode_tokens: int = 0

    def feed(self, event: Event) -> list[tuple[Event, Outcome]]:
        if isinstance(event, StepScheduled) and self.decode_tokens:
            # A step without offers allocated nothing, so its empty ``reallocated``
            # stands; only the token count and the window change.
            tokens = event.scheduled_tokens + self.decode_tokens
            depth = window_depth(self.state, scheduled_tokens=tokens,
                                 allocated_blocks=event.allocated_blocks,
                                 next_step_blocks=event.next_step_blocks)
            event = attrs.evolve(event, scheduled_tokens=tokens,
                                 window_block_ids=self.pool.window(
                                     min(depth, len(self.pool.free))))
        return super().feed(event)


def generate(directory: Path, steps: int, *, seed: int, concurrency: int,
             pool_blocks: int) -> tuple[int, str]:
    """Record ``steps`` steps into ``directory``; returns (events, a request id
    that finished near the end)."""
    rng = random.Random(seed)
    config = default_config()
    recorder = EventRecorder(config, 2, str(directory), VERSIONS, prefix="longrun",
                             max_total_bytes=None,
                             register_atexit=False)
    world = DecodeWorld(state=new_state(config, world_size=2), pool=FakePool(pool_blocks),
                        sink=recorder.record)
    prefill: dict[str, int] = {}  # chunks left
    decode: dict[str, int] = {}  # tokens left
    decoded: dict[str, int] = {}
    receipts_due: dict[int, list[str]] = {}
    next_id = 0
    last_finished = ""
    for step in range(steps):
        while len(prefill) + len(decode) < concurrency and rng.random() < 0.3:
            req_id = f"req-{next_id}"
            next_id += 1
            world.arrive(req_id)
            prefill[req_id] = rng.randint(1, 16)
        advance = list(prefill)[:4]
        for req_id, count in list(decoded.items()):
            if count and count % 64 == 0:
                advance.append(req_id)
        before = len(world.submissions)
        world.decode_tokens = len(decode)
        world.schedule(advance, next_step_blocks=len(advance) * 2)
        for store in world.submissions[before:]:
            receipts_due.setdefault(step + rng.randint(1, 3), []).append(store.req_id)
        for req_id in advance[:4]:
            if req_id in prefill:
                prefill[req_id] -= 1
                if not prefill[req_id]:
                    del prefill[req_id]
                    decode[req_id] = rng.randint(40, 600)
                    decoded[req_id] = 0
        for req_id in list(decode):
            decode[req_id] -= 1
            decoded[req_id] += 1
            if decode[req_id] <= 0:
                del decode[req_id], decoded[req_id]
                world.finish(req_id)
                last_finished = req_id
        due = receipts_due.pop(step, [])
        if due:
            failed = [r for r in due if rng.random() < 0.02]
            world.receipts(dict.fromkeys(due, 2), failed)
        world.applied.clear()
        world.submissions.clear()
    for when in sorted(receipts_due):
        world.receipts(dict.fromkeys(receipts_due[when], 2))
    world.shutdown()
    recorder.close(world.state, timeout_s=3600.0)  # the writer may lag a flat-out producer
    return recorder.events_recorded, last_finished


def _alter_last_check(source: Path, target: Path) -> None:
    """A copy of the run whose last non-empty outcome check is flipped (in a
    schema 4 log: in the last batch holding one, re-deflated with the segment's
    stream from its start, so the file still decodes)."""
    shutil.copytree(source, target)
    last = run_files(target)[-1]
    items = [item for item in scan(last.read_bytes()) if isinstance(item, Record)]
    kinds = [msgpack.unpackb(item.payload)[0] for item in items]
    start = max(i for i, kind in enumerate(kinds) if kind in (HEADER, SNAPSHOT))
    inflater, deflater = Inflater(), Deflater(6)
    batches = []
    for index in range(start + 1, len(items)):
        if kinds[index] == BATCH:
            batches.append((index, inflater.payloads(msgpack.unpackb(items[index].payload)[3])))
    altered = False
    for _index, payloads in reversed(batches):
        for at in range(len(payloads) - 1, -1, -1):
            payload = list(msgpack.unpackb(payloads[at]))
            if payload[0] == 2 and any(payload[4::2]):
                check = max(i for i in range(4, len(payload), 2) if payload[i])
                payload[check] ^= 1
                payloads[at] = msgpack.packb(payload)
                altered = True
                break
        if altered:
            break
    assert altered, "no outcome check to alter in the last segment"
    for index, payloads in batches:
        items[index] = Record(items[index].offset, encode_batch(payloads, deflater))
    # Keyed as the recorder would have keyed what the copy now holds.
    last.write_bytes(b"".join(map(frame, rekeyed([item.payload for item in items]))))


def _timed(argv: list[str]) -> tuple[float, int, str]:
    out = io.StringIO()
    started = time.perf_counter()
    code = replay_main(argv, out=out, err=io.StringIO())
    return time.perf_counter() - started, code, out.getvalue()


def _timed_cli(argv: list[str]) -> tuple[float, int]:
    """``python -m replay ARGV`` in a fresh process, as an operator runs it (this
    process's heap, the generated run's, would be inherited by forked workers)."""
    started = time.perf_counter()
    code = subprocess.run([sys.executable, "-m", "replay", *argv], stdout=subprocess.DEVNULL,
                          env={**os.environ, "PYTHONPATH": str(REPO)}).returncode
    return time.perf_counter() - started, code


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=360_000)
    parser.add_argument("--concurrency", type=int, default=48)
    parser.add_argument("--pool-blocks", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep", help="write the log here (default: a temp dir)")
    parser.add_argument("--verify-rounds", type=int, default=3,
                        help="rounds of a 1-core then an all-core verify, alternating")
    args = parser.parse_args()
    directory = Path(args.keep or tempfile.mkdtemp(prefix="bench-longrun-"))
    started = time.perf_counter()
    events, request = generate(directory, args.steps, seed=args.seed,
                               concurrency=args.concurrency, pool_blocks=args.pool_blocks)
    generate_s = time.perf_counter() - started
    files = run_files(directory)
    size = sum(f.stat().st_size for f in files)
    print(f"log: {args.steps:,} steps, {events:,} events, {len(files)} files, {size:,} bytes "
          f"at {directory} (generated in {generate_s:.0f} s)")
    print(f"bytes per step {size / args.steps:.0f}, per event {size / events:.1f}")
    speedups = []
    for round_ in range(1, args.verify_rounds + 1):
        times_s = {}
        for workers in (1, 0):
            elapsed, code = _timed_cli(["verify", str(directory), "--workers", str(workers)])
            times_s[workers] = elapsed
            label = "1 core" if workers == 1 else f"all {os.cpu_count()} cores"
            print(f"verify round {round_} ({label}): {elapsed:.1f} s = "
                  f"{args.steps / elapsed:,.0f} steps/s = {events / elapsed:,.0f} events/s "
                  f"(exit {code})")
        speedups.append(times_s[1] / times_s[0])
    print(f"verify speed-up on all {os.cpu_count()} cores, per round: "
          f"{', '.join(f'{x:.2f}x' for x in speedups)}; median {statistics.median(speedups):.2f}x")
    elapsed, code, _ = _timed(["explain", str(directory), "--request", request])
    print(f"explain --request {request} (finished near the end): {elapsed:.1f} s (exit {code})")
    early = f"req-{int(request.split('-')[1]) // 20}"
    elapsed, code, _ = _timed(["explain", str(directory), "--request", early])
    print(f"explain --request {early} (early in the run): {elapsed:.1f} s (exit {code})")
    elapsed, code, _ = _timed(["explain", str(directory), "--at", str(args.steps // 2)])
    print(f"explain --at {args.steps // 2}: {elapsed:.1f} s (exit {code})")
    altered = directory.with_name(directory.name + "-altered")
    _alter_last_check(directory, altered)
    elapsed, code, out = _timed(["diff", str(directory), str(altered), "--no-ledgers"])
    print(f"diff (diverging near the end, no ledgers): {elapsed:.1f} s (exit {code}): "
          f"{out.splitlines()[0]}")
    elapsed, code, _ = _timed(["diff", str(directory), str(altered)])
    print(f"diff (with ledgers: a replay of each last file): {elapsed:.1f} s (exit {code})")
    shutil.rmtree(altered)


if __name__ == "__main__":
    main()
