from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest

from connector.recorder.recording import EventRecorder
from offload_fsm.testing.synthetic import RecordingWorld, default_config, run_workload
from offload_fsm.vocabulary.config import OffloadConfig
from replay.cli import main
from testkit.pacing import paced
from tests.offload_fsm.helpers import Harness

VERSIONS = {"package": "test", "vllm": "", "lmcache": ""}



def run_cli(*argv: str) -> tuple[int, str, str]:
    """``replay``'s command line in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def record_harness(h: Harness, directory: Path) -> Path:
    """Everything the harness fed its machine, recorded as one closed run (prefix
    ``run``) in ``directory``; returns the directory."""
    recorder = EventRecorder(h.state.config, h.state.world_size, str(directory), VERSIONS,
                             prefix="run", register_atexit=False)
    recorder.record(h.log, h.state)
    recorder.close(h.state)
    return directory


def record_workload(
    directory: Path, *, config: OffloadConfig | None = None, world_size: int = 2,
    recorder_options: dict[str, Any] | None = None, **workload: Any,
) -> tuple[Path, RecordingWorld]:
    config = config or default_config()
    recorder = EventRecorder(config, world_size, str(directory), VERSIONS, prefix="run",
                             register_atexit=False, **(recorder_options or {}))
    # Rotation follows the writer thread: pace the producer like real steps.
    sink = paced(recorder) if "max_file_bytes" in (recorder_options or {}) else recorder.record
    world = run_workload(config=config, world_size=world_size, sink=sink, **workload)
    recorder.close(world.state)
    return directory, world


def record_rotated(directory: Path, *, requests: int) -> Path:
    """A run of ``requests`` requests rotated over 4 KiB files (three or more of them),
    for what reads a run file by file (``verify --workers``)."""
    record_workload(directory, requests=requests, seed=4, pool_blocks=64, concurrency=8,
                    recorder_options={"digest_every": 100, "max_file_bytes": 4 * 1024})
    assert len(list(directory.glob("*.lolog"))) >= 3
    return directory


@pytest.fixture
def small_log(tmp_path: Path) -> Path:
    # compress_level 0: one frame per record (no batches), which the tests cut and edit
    directory, _ = record_workload(tmp_path / "small", requests=6, seed=3, pool_blocks=24,
                                   concurrency=3, max_chunks=3,
                                   recorder_options={"digest_every": 10, "compress_level": 0})
    return directory / "run-000000.lolog"


@pytest.fixture
def mixed_log(tmp_path: Path) -> Path:
    directory, _ = record_workload(tmp_path / "mixed", requests=120, seed=5, pool_blocks=64,
                                   concurrency=8,
                                   recorder_options={"digest_every": 100, "compress_level": 0})
    return directory
