"""Keeping a log directory within its bound, across every writer of it.

Contract: a shared directory (several engines, several ``vllm serve``): each
writer holds the file it writes with an ``flock`` that dies with its
descriptor (:func:`hold_file`), and :meth:`Retention.enforce` deletes only
files no live writer holds (a file that cannot be locked, on a file system
without ``flock``, counts as held: never deleted); every writer keeps the
directory's total (all runs) within ``max_total_bytes`` less the files being
written (held files do not count, so they never starve the closed ones). A
file gone before its turn, or one this process may not delete, is skipped
(logged once per cause) and the pass goes on. Files and directories are the
owner's alone (:func:`private`, :func:`private_directory`).
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

from logfiles.runs import runs_in
from offload_fsm.log.names import file_sort_key

__all__ = ["Retention", "delete_unless_held", "discard", "held", "hold_file", "private",
           "private_directory"]


class Retention:
    """The bound of ``directory`` (None: unbounded), for one writer."""

    def __init__(self, directory: Path, max_total_bytes: int | None,
                 warn: Callable[[str], None]) -> None:
        self._dir = directory
        self._max_total_bytes = max_total_bytes
        self._warn = warn
        self._warned: set[str] = set()
        self.files_deleted = 0
        self.bytes_deleted = 0

    def hold(self, f: BinaryIO, path: Path) -> None:
        """Hold the file being written (:func:`hold_file`); say once when the file
        system cannot lock it."""
        error = hold_file(f)
        if error is not None:
            self._failed("not lockable", error,
                                   f" (a file system without flock? {path} may be deleted "
                                   "by another writer's retention; this writer deletes no "
                                   "file it cannot lock)")

    def enforce(self, current: Path | None, current_bytes: int) -> None:
        """Delete the directory's oldest log files (any run, any process, by
        modification time) until the files no live writer holds (its lock,
        :func:`held`; a file that cannot be locked counts as held), with this
        writer's own open file (``current``, ``current_bytes`` written), are
        within ``max_total_bytes``. Held files
        do not count: however large they are, the closed files keep the
        whole bound, rather than every closed file being deleted. A file
        another process deleted first, or one this process may not delete,
        is skipped (logged once per cause) and the pass goes on. Every process
        writing to the directory runs the same pass, so the bound holds
        across them, less the files being written."""
        bound = self._max_total_bytes
        if bound is None:
            return
        entries = []
        total = 0
        try:
            runs = runs_in(self._dir)
        except OSError as exc:
            self._failed("listing", exc)
            return
        for path in itertools.chain.from_iterable(runs.values()):
            if current is not None and path == current:
                total += current_bytes
                continue
            try:
                info = path.stat()
            except OSError as exc:  # gone since the listing (another writer deleted it)
                self._failed("vanished", exc)
                continue
            if not stat.S_ISREG(info.st_mode):
                continue
            entries.append((info.st_mtime_ns, file_sort_key(path.name), path, info.st_size))
            total += info.st_size
        if total <= bound:
            return
        entries.sort()
        closed = []
        for entry in entries:  # only now, past the bound: one open and lock each
            try:
                taken = held(entry[2])
            except FileNotFoundError:
                taken = True  # gone: nothing to count or delete
            except OSError as exc:  # cannot be locked: held
                self._failed("not lockable", exc)
                taken = True
            if taken:
                total -= entry[3]
            else:
                closed.append(entry)
        for _, _, path, size in closed:
            if total <= bound:
                break
            try:
                deleted = delete_unless_held(path)
            except FileNotFoundError as exc:  # another writer deleted it first
                self._failed("vanished", exc)
                total -= size
                continue
            except _Unlockable as exc:
                self._failed("not lockable", exc)
                continue
            except OSError as exc:  # not ours to delete (permissions), say
                self._failed("not deletable", exc)
                continue
            if deleted:
                total -= size
                self.files_deleted += 1
                self.bytes_deleted += size

    def _failed(self, cause: str, exc: OSError, more: str = "") -> None:
        if cause not in self._warned:
            self._warned.add(cause)
            self._warn(f"event log: retention in {self._dir}: a file {cause} ({exc!r}){more}; "
                       "skipped, the pass goes on (logged once per cause)")


def hold_file(f: BinaryIO) -> OSError | None:
    """Hold ``f`` against deletion by any writer's retention (an exclusive
    ``flock``, which dies with the file's descriptor: when the file is closed,
    or its process dies). Returns the error when the file system refused the
    lock (NFS without locks, some FUSE file systems)."""
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        return error
    return None


class _Unlockable(OSError):
    """``flock`` failed on a file (not because another holds it): retention
    treats it as held, since a writer on such a file system cannot hold it."""


@contextlib.contextmanager
def _try_lock(path: Path) -> Iterator[bool]:
    """``path`` locked while the block runs, unless a live writer holds it
    (:func:`hold_file`; then False); a file that cannot be locked at all raises
    :class:`_Unlockable`."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            locked = True
        except BlockingIOError:
            locked = False
        except OSError as error:
            raise _Unlockable(error.errno, f"cannot lock {path}: {error.strerror}") from error
        yield locked
    finally:
        os.close(fd)


def held(path: Path) -> bool:
    """Whether a live writer holds ``path`` (:func:`hold_file`); a file that
    cannot be locked counts as held (:class:`_Unlockable` is raised)."""
    with _try_lock(path) as locked:
        return not locked


def delete_unless_held(path: Path) -> bool:
    """Delete ``path`` unless a live writer holds it (:func:`hold_file`); whether
    it did. The check and the deletion happen under the lock, so a writer
    cannot take the file in between. A file that cannot be locked is never
    deleted (:class:`_Unlockable`)."""
    with _try_lock(path) as locked:
        if locked:
            path.unlink()
        return locked


def private(path: str, flags: int) -> int:
    """Open as the owner's alone (0600, or stricter by the umask)."""
    return os.open(path, flags, 0o600)


def private_directory(directory: Path, warn: Callable[[str], None]) -> None:
    """Create ``directory`` for its owner alone (0700). An existing one open
    to others is left as it is (a directory shared on purpose keeps its
    group's access and setgid bit), with a warning: the files in it are the
    owner's alone (0600), but others may see their names and sizes."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    mode = stat.S_IMODE(directory.stat().st_mode)
    if mode & 0o077:
        warn(f"event log: {directory} is open to others (mode {mode:o}); it is left as it "
             "is, the log files in it are 0600 (their names and sizes show); use a 0700 "
             "directory to keep a log's existence private")


def discard(f: BinaryIO, path: Path) -> None:
    with contextlib.suppress(OSError):
        f.close()
    with contextlib.suppress(OSError):
        path.unlink()
