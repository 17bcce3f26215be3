"""``replay``'s exit codes and its usage error, shared by its commands.

The exit codes are those ``replay.cli``'s docstring gives; :class:`UsageError`
and ``logfiles.runs.NoRun`` (a path that is no single run) both exit 2.
"""

from __future__ import annotations

from typing import Final

__all__ = ["EXIT_CORRUPT", "EXIT_DIVERGED", "EXIT_OK", "EXIT_USAGE", "UsageError"]

EXIT_OK: Final = 0
EXIT_DIVERGED: Final = 1
EXIT_USAGE: Final = 2
EXIT_CORRUPT: Final = 3


class UsageError(Exception):
    """Bad arguments: a request id or step the log does not hold, a bad
    option value (exit code 2)."""
