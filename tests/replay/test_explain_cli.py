"""explain tells the story of a block reused before drain; CLI exit codes,
summary, whatif, timeline and tail."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from connector.recorder.recording import EventRecorder
from offload_fsm import OffloadConfig, Policy, new_state
from offload_fsm.testing.synthetic import RecordingWorld
from offload_fsm.testing.world import FakePool
from replay.explain import ExplainObserver
from replay.runner import replay
from replay.tail import follow
from testkit.lmcache_server import free_port
from tests.replay.conftest import VERSIONS, run_cli

CONFIG = OffloadConfig(policy=Policy.EVICTION_AWARE, horizon_steps=2.5,
                       max_drain_per_step=8)


def _reuse_before_drain(directory: Path, pub_endpoint: str = "") -> Path:
    """A finishes while the free queue cannot spare its blocks, not even a
    chunk of them (C, still running, needs them: no shield); B's next chunk
    is allocated A's freed blocks before any drain sees them."""
    recorder = EventRecorder(CONFIG, 1, str(directory), VERSIONS, prefix="run",
                             register_atexit=False, pub_endpoint=pub_endpoint)
    world = RecordingWorld(state=new_state(CONFIG, world_size=1), pool=FakePool(4),
                           sink=recorder.record)
    world.arrive("A")
    world.arrive("C")
    world.schedule(["A", "C"], next_step_blocks=2)
    world.finish("A")
    world.arrive("B")
    world.schedule(["B"], next_step_blocks=2)
    world.finish("B")
    world.finish("C")
    world.settle_all()
    world.shutdown()
    assert world.violations == []
    recorder.close(world.state)
    return directory


def test_explain_tells_the_story_of_a_block_reused_before_drain(tmp_path: Path) -> None:
    log = _reuse_before_drain(tmp_path)
    observer = ExplainObserver("A")
    assert replay(log, observer=observer).ok
    (op,) = observer.ops
    assert (op.start_token, op.end_token, op.status, op.cause) == (0, 64, "dropped", "evicted")
    assert op.block_id in op.block_ids and op.reused_by == "B"
    texts = [line["text"] for line in observer.lines]
    assert texts[0] == "arrived" and texts[1].startswith("buffered [0, 64) on blocks")
    assert any(t.startswith("finished") for t in texts)
    reused = next(i for i, t in enumerate(texts) if "reallocated to B" in t)
    dropped = next(i for i, t in enumerate(texts) if t.startswith("DROPPED"))
    assert reused < dropped and "reused by B" in texts[dropped]
    assert texts[-1] == "LMCache session ended"

    code, out, _ = run_cli("explain", str(log), "--request", "A", "--tokens", "0:64")
    assert code == 0 and "DROPPED (evicted, block" in out and "reused by B" in out
    code, out, _ = run_cli("explain", str(log), "--request", "A", "--json")
    assert code == 0 and json.loads(out)["ops"][0]["reused_by"] == "B"
    code, _, err = run_cli("explain", str(log), "--request", "nobody")
    assert code == 2 and "does not appear" in err


def test_cli_exit_codes(tmp_path: Path, small_log: Path) -> None:
    assert run_cli("verify", str(small_log))[0] == 0
    code, out, _ = run_cli("verify", str(small_log), "--json")
    assert code == 0 and json.loads(out)["ok"] is True
    assert run_cli("verify", str(tmp_path / "missing.lolog"))[0] == 2
    assert run_cli("verify")[0] == 2
    assert run_cli("bogus")[0] == 2
    assert run_cli("explain", str(small_log), "--request", "x", "--tokens", "5:1")[0] == 2
    data = bytearray(small_log.read_bytes())
    data[40] ^= 0xFF
    small_log.write_bytes(bytes(data))
    code, _, err = run_cli("verify", str(small_log))
    assert code == 3 and "damage:" in err
    small_log.write_bytes(b"")
    assert run_cli("verify", str(small_log))[0] == 3


def test_summary_whatif_timeline(tmp_path: Path, mixed_log: Path) -> None:
    code, out, _ = run_cli("summary", str(mixed_log), "--json")
    summary = json.loads(out)
    assert code == 0 and summary["ledger_closes"]
    assert summary["ledger"]["ops"]["admitted"] > 0
    code, out, _ = run_cli("summary", str(mixed_log))
    assert code == 0 and "ledger closes: yes" in out and "deferral" in out
    code, out, _ = run_cli("whatif", str(mixed_log), "--policy", "FIFO")
    assert code == 0 and "CAVEAT" in out and "what-if FIFO" in out
    code, out, _ = run_cli("whatif", str(mixed_log), "--set", "max_drain_per_step=2", "--json")
    assert code == 0 and json.loads(out)["whatif"].startswith("EVICTION_AWARE")
    assert run_cli("whatif", str(mixed_log), "--set", "max_drain_per_step=0")[0] == 2
    html_path = tmp_path / "t.html"
    assert run_cli("timeline", str(mixed_log), "-o", str(html_path))[0] == 0
    assert "Plotly.newPlot" in html_path.read_text() and "pinned blocks" in html_path.read_text()
    code, _, err = run_cli("timeline", str(mixed_log), "-o", str(tmp_path / "t.png"))
    assert code == 2 and "expected FILE.html" in err and not (tmp_path / "t.png").exists()


def _record_until_heard(recorders: list[EventRecorder], lines: list[str],
                        labels: list[str]) -> None:
    """Steps of one short request each into every recorder, until the
    follower has printed a record under every label (a PUB socket drops what it
    sends before a subscription reaches it, and how long that takes depends
    on the box's load), then two more steps each; then the recorders close."""
    worlds = [RecordingWorld(state=new_state(CONFIG, world_size=1), pool=FakePool(8),
                             sink=recorder.record) for recorder in recorders]
    deadline = time.monotonic() + 20.0
    heard_steps = 0
    step = 0
    while heard_steps < 2:
        for world in worlds:
            world.arrive(f"r{step}")
            world.schedule([f"r{step}"], next_step_blocks=2)
            world.finish(f"r{step}")
        step += 1
        heard = all(any(line.startswith(label) and " seq " in line for line in list(lines))
                    for label in labels)
        heard_steps += heard
        assert heard or time.monotonic() < deadline, f"tail heard nothing in 20 s: {lines[-5:]}"
        time.sleep(0.05)
    for world, recorder in zip(worlds, recorders, strict=True):
        recorder.close(world.state)


def test_tail_follows_a_live_stream(tmp_path: Path) -> None:
    pytest.importorskip("zmq")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    lines: list[str] = []
    # The subscriber starts before the PUB socket binds: it connects and retries.
    thread = threading.Thread(target=lambda: follow(endpoint, lines.append, timeout_s=30.0))
    thread.start()
    time.sleep(0.3)
    recorder = EventRecorder(CONFIG, 1, str(tmp_path), VERSIONS, prefix="run",
                             register_atexit=False, pub_endpoint=endpoint, digest_every=1)
    _record_until_heard([recorder], lines, [""])
    thread.join(10)
    assert not thread.is_alive(), "tail did not stop at END"
    assert any(" inputs " in line for line in lines), lines
    assert any(" end (" in line for line in lines), lines
    assert not any("GAP" in line for line in lines), lines


def test_tail_follows_one_stream_per_engine(tmp_path: Path) -> None:
    pytest.importorskip("zmq")
    endpoints = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    lines: list[str] = []
    # The streams are bound before tail connects (a connect racing the bind
    # drops and reconnects, which restarts PUB/SUB's slow-joiner window).
    recorders = [EventRecorder(CONFIG, 1, str(tmp_path / f"e{n}"), VERSIONS, prefix="run",
                               register_atexit=False, pub_endpoint=endpoint, digest_every=1,
                               engine_index=n)
                 for n, endpoint in enumerate(endpoints)]
    thread = threading.Thread(target=lambda: follow(endpoints, lines.append, timeout_s=30.0))
    thread.start()
    _record_until_heard(recorders, lines, ["[0] ", "[1] "])
    thread.join(10)
    assert not thread.is_alive(), "tail did not stop at both ENDs"
    for label in ("[0] ", "[1] "):
        mine = [line[len(label):] for line in lines if line.startswith(label)]
        assert any(" inputs " in line for line in mine), lines
        assert any(" end (" in line for line in mine), lines
    assert not any("GAP" in line for line in lines), lines


def test_explain_summarises_block_lists_and_verbose_lists_every_id(tmp_path: Path) -> None:
    from replay.brief import blocks_text

    assert blocks_text((40, 41, 42, 43, 44, 45, 46, 47, 90, 91, 92, 93)) == \
        "blocks=12 [40-47, 90-93]"
    assert blocks_text([5]) == "blocks=1 [5]"
    assert blocks_text([]) == "blocks=0 []"
    assert blocks_text([1, 3, 5, 7, 9, 11]) == "blocks=6 [1, 3, 5, 7, +2 more runs]"
    assert blocks_text([3, 2], verbose=True) == "blocks=2 [3, 2]"
    log = _reuse_before_drain(tmp_path)
    code, out, _ = run_cli("explain", str(log), "--request", "A")
    assert code == 0
    assert "on blocks=2 [0-1]" in out
    code, out, _ = run_cli("explain", str(log), "--request", "A", "--verbose")
    assert code == 0
    assert "on blocks=2 [0, 1]" in out
