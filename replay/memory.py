"""The memory ceiling replay sets for itself.

The log decoder bounds every expansion it knows of (``offload_fsm.log.bounds``);
this is the backstop for one it does not: replay lowers its own data limit
(``RLIMIT_DATA``: the heap and private anonymous mappings, so shared
libraries and reserved-but-unused address space do not count), so an
unforeseen expansion ends in a ``MemoryError`` that the command line reports
as a clear error, never in the machine's out-of-memory killer.

The ceiling: ``--max-memory-mib`` (the CLI), else the environment variable
:data:`ENV_VAR`, else :func:`default_mib` (half the machine's memory, or of
its container's limit when lower, at most 8 GiB); 0 means none. It is per
process: ``verify --workers N``'s workers are forked and inherit it, each,
so together they may use N times it. A limit already lower (``ulimit -d``)
is kept. The previous soft limit is restored when the command returns
(tests call the CLI in-process).
"""

from __future__ import annotations

import contextlib
import os
import resource
from collections.abc import Iterator
from typing import Final

__all__ = ["CGROUP_LIMIT_FILES", "DEFAULT_MAX_MIB", "ENV_VAR", "ceiling_mib", "default_mib",
           "memory_ceiling", "parse_mib"]

ENV_VAR: Final = "LAZY_OFFLOAD_REPLAY_MAX_MEMORY_MIB"
DEFAULT_MAX_MIB: Final[int] = 8192
"""The default ceiling's cap: replaying a real run's 64 MiB log file takes a
few hundred MiB; the timeline's plot, about 1 GiB at most."""


CGROUP_LIMIT_FILES: Final = ("/sys/fs/cgroup/memory.max",
                              "/sys/fs/cgroup/memory/memory.limit_in_bytes")
"""Where a container's memory limit is (cgroup v2, v1): a limit below the
machine's memory is the one whose excess the kernel's OOM killer answers."""


def default_mib() -> int:
    """Half the memory this process may have (the machine's, or its
    container's limit when lower), at most :data:`DEFAULT_MAX_MIB`."""
    try:
        available = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        available = DEFAULT_MAX_MIB << 21
    for path in CGROUP_LIMIT_FILES:
        try:
            with open(path) as limit_file:
                text = limit_file.read().strip()
        except OSError:
            continue
        if text.isdigit():
            available = min(available, int(text))
    return max(1, min(DEFAULT_MAX_MIB, available // 2 >> 20))


def parse_mib(text: str, where: str) -> int:
    """A ceiling in MiB from ``text`` (``where`` names its source in the
    error): an integer >= 0, 0 for none. Raises ``ValueError``."""
    try:
        mib = int(text)
    except ValueError:
        mib = -1
    if mib < 0:
        raise ValueError(f"{where}={text!r} is invalid: expected a whole number of MiB "
                         ">= 0 (0: no memory ceiling)")
    return mib


def ceiling_mib(flag: int | None) -> int:
    """The ceiling in effect: the flag's, else :data:`ENV_VAR`'s, else the default."""
    if flag is not None:
        return flag
    text = os.environ.get(ENV_VAR)
    if text is not None and text.strip():
        return parse_mib(text.strip(), ENV_VAR)
    return default_mib()


@contextlib.contextmanager
def memory_ceiling(mib: int) -> Iterator[int]:
    """Lower this process's data limit to ``mib`` MiB (0: leave it) for the
    block; yields the ceiling in effect in MiB (0: none that replay set)."""
    if mib <= 0:
        yield 0
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = mib << 20
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    if soft != resource.RLIM_INFINITY and soft <= limit:
        yield soft >> 20  # already lower: kept
        return
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    try:
        yield limit >> 20
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
