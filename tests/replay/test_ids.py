"""Ids are easy: a unique prefix resolves, a miss says "did you mean" and
exits 2, as does a step outside the log (with its range); ``requests`` lists
every request with its outcome, filterable by cause; ``summary``'s top
losses give each cause and a ready-to-paste ``explain``; a directory of runs
finds the run that holds the id, and one with no log names the run folders
inside it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.replay.conftest import run_cli

DATA = Path(__file__).parent.parent / "data" / "logs"
GOLDEN = DATA / "v6"


@pytest.fixture
def two_runs(tmp_path: Path) -> Path:
    """One directory, two runs (two engines, or two servers, share it)."""
    shutil.copy(GOLDEN / "golden-000000.lolog", tmp_path / "alpha-000000.lolog")
    shutil.copy(DATA / "v1" / "golden-000000.lolog", tmp_path / "beta-000000.lolog")
    return tmp_path


def test_a_unique_prefix_resolves_and_says_so() -> None:
    code, out, err = run_cli("explain", str(GOLDEN), "--request", "s88t")
    assert code == 2 and "ambiguous: 10 ids start with it (s88t0, s88t1" in err
    code, out, err = run_cli("explain", str(GOLDEN), "--request", "s2t0")
    assert code == 0 and out.startswith("request s2t0:")
    code, out, err = run_cli("explain", str(GOLDEN), "--request", "s31t")
    assert code == 0 and out.startswith("request s31t0:")
    assert "note: request s31t is s31t0" in err


def test_a_miss_suggests_the_closest_ids_and_exits_2() -> None:
    code, out, err = run_cli("explain", str(GOLDEN), "--request", "s88t5x")
    assert code == 2 and out == ""
    assert err.startswith("error: request s88t5x does not appear in")
    assert "did you mean s88t5," in err


def test_a_step_outside_the_log_gives_its_range_and_exits_2() -> None:
    code, _, err = run_cli("explain", str(GOLDEN), "--at", "99999")
    assert code == 2 and "--at 99999: the log's token steps are 0 to 1312" in err
    code, out, _ = run_cli("explain", str(GOLDEN), "--at", "1312")
    assert code == 0 and out.startswith("token step 1312:")


def test_requests_lists_outcomes_filtered_by_cause() -> None:
    code, out, _ = run_cli("requests", str(GOLDEN), "--cause", "stale")
    assert code == 0
    lines = out.splitlines()
    assert lines[-1] == "3 requests with stale"
    assert lines[0].split() == ["s88t5", "2", "ops:", "stored", "1,", "dropped", "1",
                                "(stale);", "lost", "512", "tokens"]
    code, out, _ = run_cli("requests", str(GOLDEN), "--json")
    rows = json.loads(out)
    assert code == 0 and len(rows) == len({row["req_id"] for row in rows}) > 100
    every = sum(row["ops"] for row in rows)
    assert every >= 426  # admitted ops, split halves counted apart, plus rejected offers


def test_summary_top_losses_give_the_cause_and_the_command() -> None:
    code, out, _ = run_cli("summary", str(GOLDEN), "--top", "2")
    assert code == 0
    lines = out.splitlines()
    at = lines.index("top requests by loss (explain one: the command under it):")
    assert lines[at + 1].split()[-1] == "(evicted)"
    req_id = lines[at + 1].split()[0]
    assert lines[at + 2].strip() == f"replay explain {GOLDEN} --request {req_id}"


def test_a_directory_of_runs_finds_the_run_that_holds_the_id(two_runs: Path) -> None:
    code, out, err = run_cli("explain", str(two_runs), "--request", "s88t5")
    assert code == 0 and out.startswith("request s88t5:")
    assert "note: s88t5 is in run alpha (--prefix alpha)" in err
    shutil.copy(two_runs / "alpha-000000.lolog", two_runs / "gamma-000000.lolog")
    code, _, err = run_cli("explain", str(two_runs), "--request", "s88t5")
    assert code == 2 and "is in 2 runs" in err and "--prefix alpha, --prefix gamma" in err
    code, _, err = run_cli("explain", str(two_runs), "--request", "nobody")
    assert code == 2 and "does not appear in any of the 3 runs" in err


def test_a_folder_of_run_folders_names_them(tmp_path: Path) -> None:
    for stamp in ("20261206-101500", "20261206-111500"):
        (tmp_path / "events" / stamp).mkdir(parents=True)
        shutil.copy(GOLDEN / "golden-000000.lolog", tmp_path / "events" / stamp)
    code, _, err = run_cli("summary", str(tmp_path / "events"))
    assert code == 2
    assert (f"no .lolog files; the run folders inside it: {tmp_path}/events/20261206-101500, "
            f"{tmp_path}/events/20261206-111500 (pass one of them)") in err


def test_a_step_inside_a_quiet_run_is_found_not_refused() -> None:
    """A schema 7 log reports quiet token steps together (``StepsPassed``): a
    step inside such a run is in the log, and says so."""
    code, out, err = run_cli("explain", str(DATA / "v7"), "--at", "5")
    assert code == 0, err
    assert out.startswith("token step 5 passed quietly: seq 3 reported steps 2 to 11 together")
    code, _, err = run_cli("explain", str(DATA / "v7"), "--at", "1667")
    assert code == 2 and "the log's token steps are 0 to 1666" in err
