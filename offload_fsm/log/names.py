"""Names of event log files: ``<prefix>-<seqno:06d>.lolog``.

Pure module: standard library only; no clock, no I/O, no logging. It turns a
(prefix, seqno) pair into a file name and back; listing a directory is
``logfiles.runs``'s job, the one lister the recorder and ``replay`` share.

Primitives:
  FILE_SUFFIX            ``".lolog"``
  file_name(p, n)        the name of file ``n`` of run ``p``
  parse_file_name(name)  ``(prefix, seqno)``, or None for a name that is not a log file
  file_sort_key(name)    the order of a run's files: by prefix, then seqno

Contract:

* A run is every file sharing one prefix; the writer numbers its files from
  ``000000`` up, one per rotation. The seqno has at least six digits (more once
  a run passes 999999 files), so order files by :func:`file_sort_key`, not as text.
* The prefix is everything before the last ``-<digits>.lolog``; it may itself
  contain ``-`` and digits. ``parse_file_name(file_name(p, n)) == (p, n)`` for
  every prefix ``p`` and every ``n >= 0``.
"""

from __future__ import annotations

import re

__all__ = ["FILE_SUFFIX", "file_name", "file_sort_key", "parse_file_name"]

FILE_SUFFIX = ".lolog"
_NAME = re.compile(r"(?P<prefix>.*)-(?P<seqno>\d{6,})" + re.escape(FILE_SUFFIX), re.DOTALL)


def file_name(prefix: str, seqno: int) -> str:
    """``<prefix>-<seqno:06d>.lolog``."""
    assert seqno >= 0, seqno
    return f"{prefix}-{seqno:06d}{FILE_SUFFIX}"


def parse_file_name(name: str) -> tuple[str, int] | None:
    """The ``(prefix, seqno)`` of a log file name (a base name, not a path), or None."""
    match = _NAME.fullmatch(name)
    if match is None:
        return None
    return match["prefix"], int(match["seqno"])


def file_sort_key(name: str) -> tuple[str, int, str]:
    """Sort key for log file names: prefix, then seqno, then the name itself (which
    only breaks ties between spellings of one seqno, ``x-000001`` and ``x-0000001``).
    Raises ValueError for a name that is not a log file."""
    parsed = parse_file_name(name)
    if parsed is None:
        raise ValueError(f"not a log file name: {name!r}")
    prefix, seqno = parsed
    return prefix, seqno, name
