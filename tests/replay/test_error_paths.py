"""Every subcommand's error paths end in one ``error:`` line and a usage exit
(2), never a traceback: no such log, a directory of several runs where one is
needed, an unknown request id, a step outside the log, a path given to
``tail``; and a client-chosen request id cannot drive the terminal or flood
it through any output."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from connector.recorder.recording import EventRecorder
from tests.offload_fsm.helpers import Harness, ea
from tests.replay.conftest import VERSIONS, run_cli

DATA = Path(__file__).parent.parent / "data" / "logs"
GOLDEN = DATA / "v6"


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("runs")
    shutil.copy(GOLDEN / "golden-000000.lolog", directory / "alpha-000000.lolog")
    shutil.copy(DATA / "v5" / "golden-000000.lolog", directory / "beta-000000.lolog")
    return directory


def _cases(missing: str, runs: str, out_file: str) -> list[tuple[list[str], str]]:
    golden = str(GOLDEN)
    return [
        (["verify", missing], "no such file or directory"),
        (["explain", missing, "--request", "a"], "no such file or directory"),
        (["explain", golden, "--request", "nobody"], "does not appear in"),
        (["explain", runs, "--request", "nobody"], "does not appear in any of the 2 runs"),
        (["explain", golden, "--at", "99999"], "the log's token steps are 0 to 1312"),
        (["explain", golden, "--at", "-1"], "expected a token step >= 0"),
        (["explain", runs, "--at", "3"], "several runs (alpha, beta); pass --prefix"),
        (["requests", missing], "no such file or directory"),
        (["summary", missing], "no such file or directory"),
        (["whatif", runs, "--policy", "FIFO"], "several runs (alpha, beta); pass --prefix"),
        (["whatif", golden, "--set", "nonsense"], "expected key=value"),
        (["diff", golden, runs], "several runs (alpha, beta); pass --prefix"),
        (["timeline", runs, "-o", out_file], "several runs (alpha, beta); pass --prefix"),
        (["tail", golden], "not an endpoint"),
        (["tail", "tcp://localhost"], "expected tcp://HOST:PORT"),
    ]


def test_every_error_path_is_one_line_and_exit_2(two_runs: Path, tmp_path: Path) -> None:
    for argv, message in _cases(str(tmp_path / "missing"), str(two_runs),
                                str(tmp_path / "t.html")):
        code, out, err = run_cli(*argv)
        assert code == 2, (argv, out, err)
        assert err.startswith("error: ") and message in err, (argv, err)
        assert "Traceback" not in out + err, argv


HOSTILE = "evil\x1b]0;owned\x07\x1b[2J\u202e" + "x" * 5000


def test_a_hostile_request_id_is_escaped_and_cut_everywhere(tmp_path: Path) -> None:
    h = Harness(ea())
    h.arrive(HOSTILE)
    h.offer(HOSTILE)
    h.finish(HOSTILE, free=1000)
    h.shutdown()
    recorder = EventRecorder(h.state.config, 1, str(tmp_path), VERSIONS, prefix="run",
                             register_atexit=False)
    recorder.record(h.log, h.state)
    recorder.close(h.state)
    outputs = []
    for argv in (["explain", str(tmp_path), "--request", "evil"],
                 ["explain", str(tmp_path), "--request", "nobody\x1b[2J"],
                 ["requests", str(tmp_path)], ["summary", str(tmp_path)],
                 ["explain", str(tmp_path), "--at", "0"]):
        code, out, err = run_cli(*argv)
        outputs.append(out + err)
        assert "\x1b" not in out + err and "\x07" not in out + err, argv
        assert "\u202e" not in out + err, argv
        assert max(len(line) for line in (out + err).splitlines()) < 1000, argv
    assert "evil\\x1b]0;owned\\x07\\x1b[2J\\u202exxx" in outputs[0]
    assert "...(+" in outputs[0]


def test_a_reader_that_leaves_early_is_not_an_error() -> None:
    """``replay requests LOG | head -1``: the pipe closes under a long output;
    replay exits 0 without a traceback."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    process = subprocess.Popen([sys.executable, "-m", "replay", "requests", str(GOLDEN)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert process.stdout is not None and process.stderr is not None
    assert process.stdout.readline().startswith(b"s")
    process.stdout.close()
    error = process.stderr.read().decode()
    assert process.wait(timeout=60) == 0 and "Traceback" not in error, error
