"""offload_fsm: the deterministic core of lazy KV-cache offload.

Feed events (:mod:`offload_fsm.vocabulary.events`) to :func:`step`, or to
:func:`drive`, which also runs the command loop; each returns an
:class:`Outcome` of decisions (what the core chose and why) and commands
(what the shell must do). ``step`` is the one writer of the state: it
updates the :class:`State` it is given in place. What is pure is everything
around that: no clock, no randomness, no I/O, no logging, and nothing but
the events decides; the same events give the same decisions, commands and
digest in any process.

The layers, each a package that imports only the ones before it:

* ``vocabulary``: the words: events, commands, decisions, the outcome,
  errors, the config record, the counters.
* ``state``: the machine's records, no logic.
* ``rules``: the transitions every policy shares: legality tables, the
  request and op lifecycles, buffering, pins, selection and verification
  (``drain``), chunk splitting, plans, the tail flush, and the policy seam
  (``scope``).
* ``policies``: FIFO and EVICTION_AWARE behind that seam.
* ``machine`` (``step``, ``drive``), ``queries``, ``digest``,
  ``invariants`` and ``after_failure`` (drain-only mode) on top.
* ``log``: the event log's format: framing, records, the wire, compaction,
  snapshots, decoding, file names. It reads the vocabulary and the state,
  never the machine.

This package imports only the standard library, ``attrs`` and ``msgpack``.
"""

from offload_fsm.digest import state_digest
from offload_fsm.invariants import assert_invariants, check_all
from offload_fsm.machine import drive, step
from offload_fsm.queries import has_in_flight, watches, window_depth
from offload_fsm.state import State, new_state
from offload_fsm.vocabulary.config import (
    ConfigError,
    OffloadConfig,
    Policy,
    Settings,
    ShellConfig,
    parse_config,
)
from offload_fsm.vocabulary.errors import InvalidEvent, LogCorrupt, MachinePoisoned
from offload_fsm.vocabulary.outcome import Outcome

__all__ = [
    "ConfigError",
    "InvalidEvent",
    "LogCorrupt",
    "MachinePoisoned",
    "OffloadConfig",
    "Outcome",
    "Policy",
    "Settings",
    "ShellConfig",
    "State",
    "assert_invariants",
    "check_all",
    "drive",
    "has_in_flight",
    "new_state",
    "parse_config",
    "state_digest",
    "step",
    "watches",
    "window_depth",
]
