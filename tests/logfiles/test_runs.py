"""Runs on disk: a run's files in number order, a directory's runs, the
number a writer goes on from, and what ``replay`` is told when a path holds
no single run."""

from __future__ import annotations

from pathlib import Path

import pytest

from logfiles.runs import (
    RUN_FOLDERS_SHOWN,
    NoRun,
    files_of,
    last_seqno,
    run_files,
    run_folders,
    run_prefixes,
    runs_in,
)
from offload_fsm.log.names import file_name


def _touch(directory: Path, *names: str) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        (directory / name).write_bytes(b"")


def test_a_runs_files_are_in_number_order_not_text_order(tmp_path: Path) -> None:
    # As text, run-1000000 sorts before run-999999.
    _touch(tmp_path, file_name("run", 1_000_000), file_name("run", 999_999), file_name("run", 2))
    assert [f.name for f in files_of(tmp_path, "run")] == [
        "run-000002.lolog", "run-999999.lolog", "run-1000000.lolog"]


def test_only_regular_files_with_log_names_belong_to_a_run(tmp_path: Path) -> None:
    _touch(tmp_path, file_name("a", 0), file_name("b-7", 1), "a-000001.lolog.tmp", "notes.txt",
           "a-12.lolog")
    (tmp_path / file_name("a", 5)).mkdir()
    assert {prefix: [f.name for f in files] for prefix, files in runs_in(tmp_path).items()} == {
        "a": ["a-000000.lolog"], "b-7": ["b-7-000001.lolog"]}
    assert files_of(tmp_path, "c") == []


def test_a_missing_directory_raises_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        files_of(tmp_path / "gone", "run")


def test_the_last_seqno_counts_every_entry_named_for_the_run(tmp_path: Path) -> None:
    assert last_seqno(tmp_path, "run") == -1
    _touch(tmp_path, file_name("run", 3), file_name("run", 12), file_name("other", 40))
    (tmp_path / file_name("run", 13)).mkdir()  # a writer must not reuse its name either
    assert last_seqno(tmp_path, "run") == 13
    assert last_seqno(tmp_path, "other") == 40


def test_run_prefixes_names_runs_only_when_there_are_several(tmp_path: Path) -> None:
    _touch(tmp_path / "one", file_name("x", 0), file_name("x", 1))
    _touch(tmp_path / "two", file_name("b", 0), file_name("a", 0))
    assert run_prefixes(tmp_path / "one") == [None]
    assert run_prefixes(tmp_path / "one" / file_name("x", 0)) == [None]
    assert run_prefixes(tmp_path / "two") == ["a", "b"]


def test_run_files_of_a_file_a_run_and_a_prefix(tmp_path: Path) -> None:
    _touch(tmp_path, file_name("b", 1), file_name("b", 0), file_name("a", 0))
    single = tmp_path / file_name("a", 0)
    assert run_files(single) == [single]
    assert [f.name for f in run_files(tmp_path, "b")] == ["b-000000.lolog", "b-000001.lolog"]
    with pytest.raises(NoRun, match=r"several runs \(a, b\); pass --prefix"):
        run_files(tmp_path)
    with pytest.raises(NoRun, match="no .lolog files with prefix 'c'"):
        run_files(tmp_path, "c")
    with pytest.raises(NoRun, match="no such file or directory"):
        run_files(tmp_path / "gone")


def test_a_parent_folder_names_the_run_folders_inside_it(tmp_path: Path) -> None:
    for number in range(RUN_FOLDERS_SHOWN + 2):
        _touch(tmp_path / f"run{number:02d}", file_name("x", 0))
    _touch(tmp_path / "empty")
    folders = run_folders(tmp_path)
    assert folders == [str(tmp_path / f"run{n:02d}") for n in range(RUN_FOLDERS_SHOWN + 2)]
    with pytest.raises(NoRun, match=r"run folders inside it: .*run07 and 2 more \(pass one"):
        run_files(tmp_path)
    with pytest.raises(NoRun) as raised:
        run_files(tmp_path / "empty")
    assert str(raised.value) == f"{tmp_path / 'empty'}: no .lolog files"
