"""Write the golden event log of the current schema version (run once per
version; the files are kept forever and must keep replaying clean).

    .venv/bin/python tests/data/make_golden.py

Writes ``tests/data/logs/v<SCHEMA_VERSION>/golden-000000.lolog`` (a small
seeded workload with preemptions, failed stores and evictions, recorded by
the connector's recorder with a digest every 25 events and, from schema 4, a
snapshot every 50, so it holds several segments) and ``expected.json``
(event count and final digest) next to it. Refuses to overwrite.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from connector.recording import EventRecorder
from offload_fsm.codec import state_digest
from offload_fsm.logformat import SCHEMA_VERSION
from offload_fsm.testing.synthetic import default_config, run_workload


def main() -> int:
    directory = Path(__file__).parent / "logs" / f"v{SCHEMA_VERSION}"
    if any(directory.glob("*.lolog")):
        print(f"{directory} already holds a golden log; golden logs are never rewritten")
        return 1
    directory.mkdir(parents=True, exist_ok=True)
    config = default_config()
    recorder = EventRecorder(config, 2, str(directory),
                             {"package": "golden", "vllm": "", "lmcache": ""},
                             prefix="golden", digest_every=25, snapshot_every=50,
                             register_atexit=False)
    world = run_workload(requests=24, seed=11, config=config, pool_blocks=40, concurrency=5,
                         max_chunks=4, fail_rate=0.1, sink=recorder.record)
    recorder.close(world.state)
    expected = {"schema": SCHEMA_VERSION, "events": len(world.applied),
                "final_digest": state_digest(world.state),
                "counters": {k: v for k, v in world.state.counters.items() if v}}
    (directory / "expected.json").write_text(json.dumps(expected, indent=2) + "\n")
    print(f"wrote {directory}: {len(world.applied)} events")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.exit(main())
