"""explain names a chunk-granularity cut (``OpSplit``) and follows both
halves: the front's store and the rest's own fate."""

from __future__ import annotations

import io
from pathlib import Path

from connector.recorder.recording import EventRecorder
from replay.cli import main
from tests.offload_fsm.helpers import Harness, ea
from tests.replay.conftest import VERSIONS


def test_explain_names_the_split_and_follows_both_halves(tmp_path: Path) -> None:
    h = Harness(ea())
    h.arrive("a")
    blocks = h.new_blocks(12)
    h.offer("a", blocks=blocks, tokens=384, blocks_per_chunk=2)
    h.finish("a", free=0)
    h.queue = [*blocks, 10_000, 10_001, 10_002]  # headroom 15 - 4: five chunks of six
    h.tick(allocated=20, requests=1)
    h.tick(allocated=20, requests=1, reallocated=((blocks[11], 999_999),))
    h.complete("a")
    recorder = EventRecorder(h.state.config, 1, str(tmp_path), VERSIONS, prefix="run",
                             register_atexit=False)
    recorder.record(h.log, h.state)
    recorder.close(h.state)
    out, err = io.StringIO(), io.StringIO()
    assert main(["explain", str(tmp_path / "run-000000.lolog"), "--request", "a"],
                out=out, err=err) == 0, err.getvalue()
    text = out.getvalue()
    assert ("SPLIT [0, 384) at token 320: only its first 10 blocks fit the pin headroom "
            "(pin_budget); [320, 384) stays buffered") in text
    stories = {line.split(":")[0].strip(): line for line in text.splitlines()
               if line.startswith("  [")}
    assert stories["[0, 320)"].endswith("-> STORED")
    assert "blocks=10 [0-9]" in stories["[0, 320)"]
    assert stories["[320, 384)"].endswith("-> DROPPED (evicted, block 11)")
    assert "blocks=2 [10-11]" in stories["[320, 384)"]
