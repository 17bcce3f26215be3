"""Write the golden event log of the current schema version (run once per
version; the files are kept forever and must keep replaying clean).

    .venv/bin/python tests/data/make_golden.py

Writes ``tests/data/logs/v<SCHEMA_VERSION>/golden-000000.lolog`` (a small
seeded workload with preemptions, failed stores and evictions, recorded by
the connector's recorder with a digest every 25 events and, from schema 4, a
snapshot every 50, so it holds several segments) and ``expected.json``
(event count and final digest) next to it. Refuses to overwrite.

From schema 5 (block-id runs, compact snapshot ops: forms only prefix-cache
hits produce, which the synthetic workload has none of) the golden log is
instead the first 3,000 events of the kept simulator log
``tests/data/sim_logs/sim-ea-3`` (the real vLLM scheduler, a shared system
prompt) recorded again (``testkit.rerecord``), with a digest every 250 events
and a snapshot every 1,000. From schema 7 (``StepsPassed``) every step the
shell would pass today goes in a ``StepsPassed``, as the connector records
it (``rerecord(..., pass_quiet_steps=True)``).

From schema 8 (``LookupAnswered``: fed only where a waiting request's
allocation can reach buffered blocks, which sim-ea-3's traffic never
recorded) the source is ``tests/data/sim_logs/sim-ea-burst``: the
simulator's burst-repeat log at the issue12-small scale, recorded with the
lookup shield (``python -m bench.simulate --scale issue12-small --configs 2
--arms "ours EA"``), its first 3,000 events.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from connector.recorder.recording import EventRecorder
from offload_fsm.digest import state_digest
from offload_fsm.log.records import SCHEMA_VERSION
from replay.runner import config_of
from testkit.rerecord import rerecord


def main() -> int:
    directory = Path(__file__).parent / "logs" / f"v{SCHEMA_VERSION}"
    if any(directory.glob("*.lolog")):
        print(f"{directory} already holds a golden log; golden logs are never rewritten")
        return 1
    directory.mkdir(parents=True, exist_ok=True)
    versions = {"package": "golden", "vllm": "", "lmcache": ""}
    source = Path(__file__).parent / "sim_logs" / "sim-ea-burst"
    recorder, state, events = rerecord(
        source, lambda header: EventRecorder(
            config_of(header), header.world_size, str(directory), versions, prefix="golden",
            digest_every=250, snapshot_every=1000, register_atexit=False),
        limit_events=3000, pass_quiet_steps=True)
    recorder.close(state)
    expected = {"schema": SCHEMA_VERSION, "events": events, "source": source.name,
                "final_digest": state_digest(state),
                "counters": {k: v for k, v in state.counters.items() if v}}
    (directory / "expected.json").write_text(json.dumps(expected, indent=2) + "\n")
    print(f"wrote {directory}: {events} events")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.exit(main())
