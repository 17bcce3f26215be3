"""Runs on disk: a run is every ``<prefix>-<seqno>.lolog`` file sharing one
prefix in one directory (:mod:`offload_fsm.log.names`).

Contract: lists directories, never opens a log file. Every list of a run's
files is in :func:`~offload_fsm.log.names.file_sort_key` order (by number,
not as text: a run past file 999999 has seven-digit numbers). Only regular
files count as a run's files; :func:`last_seqno` counts every entry with a
log file's name, since a writer must not reuse a name, whatever holds it.

* :func:`runs_in` / :func:`files_of`: a directory's runs, or one run's files
  (a missing directory raises ``FileNotFoundError``; the recorder treats that
  as "no run yet").
* :func:`last_seqno`: the number of a run's last file (-1: none), where a
  writer taking the run over goes on.
* :func:`run_prefixes` / :func:`run_files`: what a ``replay`` command is
  given: a file, a directory of one run, or one of several with a prefix;
  :class:`NoRun` says what to pass instead (the run folders inside a parent
  folder, the prefixes of a shared directory).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Final

from offload_fsm.log.names import FILE_SUFFIX, file_sort_key, parse_file_name

__all__ = ["RUN_FOLDERS_SHOWN", "NoRun", "files_of", "last_seqno", "run_files", "run_folders",
           "run_prefixes", "runs_in"]

RUN_FOLDERS_SHOWN: Final = 8  # the run folders a NoRun message names


class NoRun(Exception):
    """A path that is no run of log files, or holds several where one was
    asked for; the message says which, and what to pass."""


def runs_in(directory: str | os.PathLike[str]) -> dict[str, list[Path]]:
    """Each prefix of ``directory`` (sorted) with its files, in run order."""
    runs: dict[str, list[Path]] = {}
    base = Path(directory)
    with os.scandir(base) as entries:
        for entry in entries:
            parsed = parse_file_name(entry.name)
            if parsed is not None and entry.is_file():
                runs.setdefault(parsed[0], []).append(base / entry.name)
    return {prefix: sorted(runs[prefix], key=lambda file: file_sort_key(file.name))
            for prefix in sorted(runs)}


def files_of(directory: str | os.PathLike[str], prefix: str) -> list[Path]:
    """The files of run ``prefix`` in ``directory``, in run order (empty: none)."""
    return runs_in(directory).get(prefix, [])


def last_seqno(directory: str | os.PathLike[str], prefix: str) -> int:
    """The highest file number any entry of ``directory`` named for run
    ``prefix`` has; -1 when there is none."""
    return max((parsed[1] for parsed in map(parse_file_name, os.listdir(directory))
                if parsed is not None and parsed[0] == prefix), default=-1)


def run_prefixes(path: str | os.PathLike[str]) -> list[str | None]:
    """The runs of ``path``: a directory's prefixes, sorted, when it holds
    several (several engines, or several servers, may share one); ``[None]``
    for a file or a directory of one run (or none: :func:`run_files` says)."""
    target = Path(path)
    if not target.is_dir():
        return [None]
    prefixes = list(runs_in(target))
    return [*prefixes] if len(prefixes) > 1 else [None]


def run_files(path: str | os.PathLike[str], prefix: str | None = None) -> list[Path]:
    """The files of one run: ``path`` itself (a file), or the log files of a
    directory in run order: its one run, or run ``prefix``. Raises
    :class:`NoRun` when there is no such path, no such run, or several runs
    and no ``prefix``."""
    target = Path(path)
    if target.is_file():
        return [target]
    if not target.is_dir():
        raise NoRun(f"{path}: no such file or directory")
    runs = runs_in(target)
    if prefix is not None:
        runs = {k: v for k, v in runs.items() if k == prefix}
    if not runs:
        inside = [] if prefix else run_folders(target)
        raise NoRun(f"{path}: no {FILE_SUFFIX} files" + (
            f" with prefix {prefix!r}" if prefix else
            "; the run folders inside it: " + ", ".join(inside[:RUN_FOLDERS_SHOWN])
            + (f" and {len(inside) - RUN_FOLDERS_SHOWN} more" if len(inside) >
               RUN_FOLDERS_SHOWN else "") + " (pass one of them)" if inside else ""))
    if len(runs) > 1:
        raise NoRun(f"{path}: several runs ({', '.join(runs)}); pass --prefix")
    ((_, files),) = runs.items()
    return files


def run_folders(directory: str | os.PathLike[str]) -> list[str]:
    """The folders directly inside ``directory`` that hold a log file, in
    name order (the demo and the connector name them by start time, so the
    newest is last); a folder that cannot be listed is left out."""
    folders = []
    for child in sorted(Path(directory).iterdir()):
        with contextlib.suppress(OSError):
            if child.is_dir() and any(parse_file_name(f.name) is not None
                                      for f in child.iterdir()):
                folders.append(str(child))
    return folders
