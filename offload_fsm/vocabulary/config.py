"""Lazy-offload configuration: one frozen object parsed from vLLM's
``kv_connector_extra_config``.

Keys (spec ``lazy-offload.md`` plus LMCache's EVICTION_AWARE knobs):

=============================================  ================  ===========================
key                                            default           allowed
=============================================  ================  ===========================
``lmcache.mp.lazy_offload``                    ``false``         JSON boolean
``lmcache.mp.lazy_offload_policy``             ``EVICTION_AWARE`` ``EVICTION_AWARE``, ``FIFO``
``lmcache.mp.lazy_offload_threshold``          ``100``           integer >= 1 (FIFO)
``lmcache.mp.lazy_offload_select_count``       ``10``            integer >= 1 (FIFO)
``lmcache.mp.lazy_offload_horizon_steps``      ``2.5``           finite number > 0 (EA)
``lmcache.mp.lazy_offload_max_drain_per_step`` ``64``            integer >= 1 (EA)
``lmcache.mp.lazy_offload_max_deferral_seconds`` ``0``           finite number >= 0 (EA)
``lmcache.mp.lazy_offload_log_dir``            see connector     path string or ``""`` (off)
``lmcache.mp.lazy_offload_log_pub_endpoint``   ``""`` (off)      ZeroMQ endpoint, e.g. ``tcp://127.0.0.1:5600``
``lmcache.mp.lazy_offload_receipt_lease_s``     ``300``           finite number >= 0 (0: no lease)
``lmcache.mp.lazy_offload_log_max_total_mib``  ``1024``          finite number > 0 (log dir total)
``lmcache.mp.lazy_offload_log_max_file_mib``   ``64``            finite number > 0, <= total
``lmcache.mp.lazy_offload_chunk_split``        ``true``          JSON boolean (EA: ``split``)
``lmcache.mp.lazy_offload_cascade_lookahead_blocks`` ``1024``  integer >= 0 (EA cascade read)
``lmcache.mp.lazy_offload_idle_flush_steps``   ``0`` (off)       integer >= 0 (tail flush)
``lmcache.mp.lazy_offload_shutdown_flush_s``   ``0`` (off)       finite number >= 0 (tail flush)
=============================================  ================  ===========================

The two flush keys (``offload_fsm.rules.tail_flush``) are off by default, as the spec
has it (the idle tail is not flushed automatically); with them off the
machine behaves, decides and digests exactly as before they existed.

Contract: :func:`parse_config` either returns a fully valid :class:`OffloadConfig`
or raises :class:`ConfigError` naming the key, the value and what is allowed.
Nothing is coerced silently: a boolean given as the string ``"true"`` is an
error, a count of ``8.9`` is an error (upstream truncates it), NaN and
infinities are errors, and an unknown ``lmcache.mp.lazy_offload_*`` key is an
error that suggests the closest valid key (upstream ignores typos, so a
misspelt ``max_drain_per_step`` silently kept 64). Integral strings such as
``"8"`` and numeric strings such as ``"1.5"`` are accepted for numeric knobs,
because JSON configs written by shell scripts carry them (upstream accepts them
too). Policy names are matched case-insensitively.
"""

from __future__ import annotations

import difflib
import enum
import math
from collections.abc import Mapping

import attrs

PREFIX = "lmcache.mp.lazy_offload"


class Policy(enum.Enum):
    """Drain policy. Values are wire-stable strings."""

    EVICTION_AWARE = "EVICTION_AWARE"
    FIFO = "FIFO"

    # Keys hot tables: Enum's __hash__ runs in Python; members are singletons,
    # so the C identity hash is equivalent (and much faster).
    __hash__ = object.__hash__


class ConfigError(ValueError):
    """A lazy-offload key has a value that is not allowed."""

    def __init__(self, key: str, value: object, allowed: str) -> None:
        self.key = key
        self.value = value
        self.allowed = allowed
        super().__init__(f"{key}={value!r} is invalid: expected {allowed}")


@attrs.frozen(kw_only=True)
class OffloadConfig:
    """The validated lazy-offload settings. Field names match the key suffixes."""

    enabled: bool = False
    policy: Policy = Policy.EVICTION_AWARE
    threshold: int = 100
    select_count: int = 10
    horizon_steps: float = 2.5
    max_drain_per_step: int = 64
    max_deferral_seconds: float = 0.0
    log_dir: str | None = None
    log_pub_endpoint: str = ""
    # A submitted batch whose receipts have not all arrived this long after its
    # selection (logical time, from events) is abandoned. 300 s is LMCache's own
    # longest wait on its server (``mq_timeout``) and 10x its dead-server
    # detection (three missed 10 s heartbeats), after which LMCache itself
    # reports every pending store; so only a lost receipt ever reaches it.
    receipt_lease_s: float = 300.0
    # Disk use of the event log: the directory's total over all runs (oldest
    # files deleted first, never the file being written) and the rotation size.
    log_max_total_mib: float = 1024.0
    log_max_file_mib: float = 64.0
    # The tail flush (``offload_fsm.rules.tail_flush``): after this many consecutive empty
    # steps, submit the intact buffered ops of finished requests (0: never).
    idle_flush_steps: int = 0
    # When vLLM begins shutting down, submit them too and keep the engine
    # stepping at most this long for their receipts (0: never).
    shutdown_flush_s: float = 0.0
    # EVICTION_AWARE: an op too big for the pin or shield headroom is cut to
    # its chunk prefix that fits (``offload_fsm.rules.split``) instead of waiting
    # whole. Off only to replay logs recorded before the rule existed.
    chunk_split: bool = True
    # EVICTION_AWARE: a pin-cascade re-read takes this many free-queue blocks
    # beyond the danger depth, so the rounds after it plan from what it read
    # instead of reading again (``eviction_aware``). 0: one read per round, as
    # logs recorded before the key existed replay.
    cascade_lookahead_blocks: int = 1024

    def __attrs_post_init__(self) -> None:
        _validate(self)

    def describe(self) -> str:
        """The knobs that matter for the configured policy, for the start-up log line."""
        if self.policy is Policy.FIFO:
            return f"threshold={self.threshold} select_count={self.select_count}"
        return (
            f"horizon_steps={self.horizon_steps} max_drain_per_step={self.max_drain_per_step}"
            f" max_deferral_seconds={self.max_deferral_seconds}"
        )

    def to_wire(self) -> dict[str, object]:
        """A plain dict keyed by the full config keys, for log headers."""
        return {
            PREFIX: self.enabled,
            f"{PREFIX}_policy": self.policy.value,
            f"{PREFIX}_threshold": self.threshold,
            f"{PREFIX}_select_count": self.select_count,
            f"{PREFIX}_horizon_steps": self.horizon_steps,
            f"{PREFIX}_max_drain_per_step": self.max_drain_per_step,
            f"{PREFIX}_max_deferral_seconds": self.max_deferral_seconds,
            f"{PREFIX}_log_dir": self.log_dir if self.log_dir is not None else "",
            f"{PREFIX}_log_pub_endpoint": self.log_pub_endpoint,
            f"{PREFIX}_receipt_lease_s": self.receipt_lease_s,
            f"{PREFIX}_log_max_total_mib": self.log_max_total_mib,
            f"{PREFIX}_log_max_file_mib": self.log_max_file_mib,
            f"{PREFIX}_idle_flush_steps": self.idle_flush_steps,
            f"{PREFIX}_shutdown_flush_s": self.shutdown_flush_s,
            f"{PREFIX}_chunk_split": self.chunk_split,
            f"{PREFIX}_cascade_lookahead_blocks": self.cascade_lookahead_blocks,
        }


def _bool(key: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    raise ConfigError(key, value, "a JSON boolean true or false (not a string or number)")


def _positive_int(key: str, value: object) -> int:
    return _integer(key, value, minimum=1, allowed="an integer >= 1")


def _count(key: str, value: object) -> int:
    return _integer(key, value, minimum=0, allowed="an integer >= 0 (0: off)")


def _integer(key: str, value: object, *, minimum: int, allowed: str) -> int:
    if isinstance(value, bool):
        raise ConfigError(key, value, allowed)
    digits = value.strip().lstrip("+") if isinstance(value, str) else ""
    if isinstance(value, int):
        number = value
    elif digits.isascii() and digits.isdigit():
        number = int(digits)
    elif isinstance(value, float) and value.is_integer():  # rejects NaN and inf too
        number = int(value)
    else:
        raise ConfigError(key, value, allowed)
    if number < minimum:
        raise ConfigError(key, value, allowed)
    return number


def _finite_float(key: str, value: object, *, minimum: float, inclusive: bool) -> float:
    allowed = f"a finite number {'>=' if inclusive else '>'} {minimum:g}"
    if isinstance(value, bool):
        raise ConfigError(key, value, allowed)
    if isinstance(value, int | float):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            raise ConfigError(key, value, allowed) from None
    else:
        raise ConfigError(key, value, allowed)
    if not math.isfinite(number):
        raise ConfigError(key, value, allowed)
    if number < minimum or (number == minimum and not inclusive):
        raise ConfigError(key, value, allowed)
    return number


def _policy(key: str, value: object) -> Policy:
    names = ", ".join(p.value for p in Policy)
    if isinstance(value, Policy):
        return value
    if isinstance(value, str):
        for policy in Policy:
            if value.strip().upper() == policy.value:
                return policy
    raise ConfigError(key, value, f"one of {names}")


def _log_dir(key: str, value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    raise ConfigError(key, value, 'a directory path string, or "" to turn the event log off')


_PARSERS = {
    PREFIX: ("enabled", _bool),
    f"{PREFIX}_policy": ("policy", _policy),
    f"{PREFIX}_threshold": ("threshold", _positive_int),
    f"{PREFIX}_select_count": ("select_count", _positive_int),
    f"{PREFIX}_horizon_steps": (
        "horizon_steps",
        lambda k, v: _finite_float(k, v, minimum=0.0, inclusive=False),
    ),
    f"{PREFIX}_max_drain_per_step": ("max_drain_per_step", _positive_int),
    f"{PREFIX}_max_deferral_seconds": (
        "max_deferral_seconds",
        lambda k, v: _finite_float(k, v, minimum=0.0, inclusive=True),
    ),
    f"{PREFIX}_log_dir": ("log_dir", _log_dir),
}

def _endpoint(key: str, value: object) -> str:
    if isinstance(value, str) and (value == "" or "://" in value):
        return value
    raise ConfigError(key, value, 'a ZeroMQ endpoint such as "tcp://127.0.0.1:5600", or ""')


_PARSERS[f"{PREFIX}_log_pub_endpoint"] = ("log_pub_endpoint", _endpoint)
_PARSERS[f"{PREFIX}_receipt_lease_s"] = (
    "receipt_lease_s", lambda k, v: _finite_float(k, v, minimum=0.0, inclusive=True)
)
_PARSERS[f"{PREFIX}_log_max_total_mib"] = (
    "log_max_total_mib", lambda k, v: _finite_float(k, v, minimum=0.0, inclusive=False)
)
_PARSERS[f"{PREFIX}_log_max_file_mib"] = (
    "log_max_file_mib", lambda k, v: _finite_float(k, v, minimum=0.0, inclusive=False)
)

_PARSERS[f"{PREFIX}_idle_flush_steps"] = ("idle_flush_steps", _count)
_PARSERS[f"{PREFIX}_shutdown_flush_s"] = (
    "shutdown_flush_s", lambda k, v: _finite_float(k, v, minimum=0.0, inclusive=True)
)

_PARSERS[f"{PREFIX}_chunk_split"] = ("chunk_split", _bool)
_PARSERS[f"{PREFIX}_cascade_lookahead_blocks"] = (
    "cascade_lookahead_blocks",
    lambda k, v: _integer(k, v, minimum=0, allowed="an integer >= 0 (0: read once a round)"),
)

# Keys a log header may lack because it was recorded before they existed: the
# value that reproduces the recorder's behaviour then.
_BEFORE_THEY_EXISTED: dict[str, object] = {
    f"{PREFIX}_receipt_lease_s": 0.0,
    f"{PREFIX}_idle_flush_steps": 0,
    f"{PREFIX}_shutdown_flush_s": 0.0,
    f"{PREFIX}_chunk_split": False,
    f"{PREFIX}_cascade_lookahead_blocks": 0,
}

KNOWN_KEYS: tuple[str, ...] = tuple(_PARSERS)


def _validate(config: OffloadConfig) -> None:
    """A config built directly is checked as :func:`parse_config` checks its
    keys, and must already hold typed values (no strings for numbers); the
    :class:`ConfigError` names the field (``parse_config`` names the key)."""
    for name, parse in _PARSERS.values():
        value = getattr(config, name)
        parsed = parse(name, value)
        exact = type(parsed) is type(value) or (type(parsed) is float and type(value) is int)
        if parsed != value or not exact:
            kind = type(parsed).__name__
            raise ConfigError(name, value, f"a value of type {kind} (parse_config takes"
                              " strings; OffloadConfig takes typed values)")
    if config.log_max_file_mib > config.log_max_total_mib:
        raise ConfigError("log_max_file_mib", config.log_max_file_mib,
                          f"at most {PREFIX}_log_max_total_mib ({config.log_max_total_mib:g}):"
                          " a file is never deleted while it is written")


def parse_config(extra_config: Mapping[str, object]) -> OffloadConfig:
    """Parse the lazy-offload keys of ``kv_connector_extra_config``.

    Keys outside the ``lmcache.mp.lazy_offload`` family are ignored (they belong
    to LMCache's connector). Raises :class:`ConfigError` on the first bad key.
    """
    fields: dict[str, object] = {}
    for key, value in extra_config.items():
        if not key.startswith(PREFIX):
            continue
        if key not in _PARSERS:
            close = difflib.get_close_matches(key, KNOWN_KEYS, n=1, cutoff=0.0)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(key, value, f"a known key ({', '.join(KNOWN_KEYS)}){hint}")
        name, parse = _PARSERS[key]
        fields[name] = parse(key, value)
    try:
        return OffloadConfig(**fields)  # type: ignore[arg-type]
    except ConfigError as error:  # a check across fields (_validate): name the key
        key = next((k for k, (name, _) in _PARSERS.items() if name == error.key), error.key)
        raise ConfigError(key, error.value, error.allowed) from None


def parse_recorded_config(wire: Mapping[str, object]) -> OffloadConfig:
    """The config of a log header (``OffloadConfig.to_wire``); keys added
    after the log was recorded take the values it was recorded under."""
    return parse_config({**_BEFORE_THEY_EXISTED, **wire})
