"""offload_fsm: the pure, deterministic core of lazy KV-cache offload.

Feed :mod:`offload_fsm.events` to :func:`step` (or :func:`drive`, which also
runs the command loop); it returns an :class:`Outcome` of decisions (what it
chose and why) and commands (what the shell must do). The transition rules
and the theory of operation are in :mod:`offload_fsm.machine`; the drain
policies in :mod:`offload_fsm.policies`; the checkers in
:mod:`offload_fsm.invariants`. This package imports only the standard
library, ``attrs`` and ``msgpack``.
"""

from offload_fsm.codec import decode, encode, state_digest
from offload_fsm.config import ConfigError, OffloadConfig, Policy, parse_config
from offload_fsm.errors import InvalidEvent, LogCorrupt, MachinePoisoned
from offload_fsm.invariants import assert_invariants, check_all
from offload_fsm.machine import Outcome, drive, has_in_flight, step, watches, window_depth
from offload_fsm.state import State, new_state

__all__ = [
    "ConfigError",
    "InvalidEvent",
    "LogCorrupt",
    "MachinePoisoned",
    "OffloadConfig",
    "Outcome",
    "Policy",
    "State",
    "assert_invariants",
    "check_all",
    "decode",
    "drive",
    "encode",
    "has_in_flight",
    "new_state",
    "parse_config",
    "state_digest",
    "step",
    "watches",
    "window_depth",
]
