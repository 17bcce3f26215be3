"""Where ``replay`` read logs before ``logfiles``: the names callers outside
replay's own modules still import from here (``replay.whatif``, ``testkit``,
the connector, e2e and snapshot tests). Each is defined in ``logfiles``;
switch those imports and delete this module.
"""

from __future__ import annotations

from logfiles.runs import run_files, run_prefixes
from logfiles.scan import Entry, LogDamage, read_file, read_log

__all__ = ["Entry", "LogDamage", "read_file", "read_log", "run_files", "run_prefixes"]
