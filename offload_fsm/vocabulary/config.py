"""Lazy-offload configuration: every ``lmcache.mp.lazy_offload*`` key of
vLLM's ``kv_connector_extra_config``, parsed and validated in one place.

Two frozen records hold the result (:class:`Settings`): :class:`OffloadConfig`,
what the core reads (``State.config``), and :class:`ShellConfig`, what only the
connector reads (whether lazy offload is on, the event log's directory,
stream and disk bounds). One key table (``_KEYS``) names every key, its
record, field and parser, so an unknown key is refused against all of them.

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
``lmcache.mp.lazy_offload_log_pub_endpoint``   ``""`` (off)      loopback tcp:// or ipc://
``lmcache.mp.lazy_offload_log_pub_allow_remote`` ``false``       JSON boolean (any address)
``lmcache.mp.lazy_offload_log_budget_mib``     ``64``            finite number >= 4 (snapshot)
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

Contract: :func:`parse_config` either returns fully valid :class:`Settings`
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
from collections.abc import Callable, Mapping
from typing import Final

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
    """The settings the core reads (``State.config``). Field names match the
    key suffixes."""

    policy: Policy = Policy.EVICTION_AWARE
    threshold: int = 100
    select_count: int = 10
    horizon_steps: float = 2.5
    max_drain_per_step: int = 64
    max_deferral_seconds: float = 0.0
    # A submitted batch whose receipts have not all arrived this long after its
    # selection (logical time, from events) is abandoned. 300 s is LMCache's own
    # longest wait on its server (``mq_timeout``) and 10x its dead-server
    # detection (three missed 10 s heartbeats), after which LMCache itself
    # reports every pending store; so only a lost receipt ever reaches it.
    receipt_lease_s: float = 300.0
    # The tail flush (``rules.tail_flush``): after this many consecutive empty
    # steps, submit the intact buffered ops of finished requests (0: never).
    idle_flush_steps: int = 0
    # When vLLM begins shutting down, submit them too and keep the engine
    # stepping at most this long for their receipts (0: never).
    shutdown_flush_s: float = 0.0
    # EVICTION_AWARE: an op too big for the pin or shield headroom is cut to
    # its chunk prefix that fits (``rules.split``) instead of waiting whole.
    # Off only to replay logs recorded before the rule existed.
    chunk_split: bool = True
    # EVICTION_AWARE: a pin-cascade re-read takes this many free-queue blocks
    # beyond the danger depth, so the rounds after it plan from what it read
    # instead of reading again (``policies.eviction_aware``). 0: one read per
    # round, as logs recorded before the key existed replay.
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


@attrs.frozen(kw_only=True)
class ShellConfig:
    """The settings only the connector reads: whether lazy offload is on, and
    where and how much the event log writes. Field names match the key
    suffixes (``enabled`` is the bare ``lmcache.mp.lazy_offload`` key)."""

    enabled: bool = False
    log_dir: str | None = None  # None: the connector's default directory
    log_pub_endpoint: str = ""
    # Disk use of the event log: the directory's total over all runs (oldest
    # files deleted first, never the file being written) and the rotation size.
    log_max_total_mib: float = 1024.0
    log_max_file_mib: float = 64.0
    # The bytes of events handed to the recorder process and not yet taken
    # in, on the engine's side; and what the recorder's writer may queue.
    # At least LOG_BUDGET_MIN_MIB: a snapshot of a full state must fit.
    log_budget_mib: float = 64.0
    # The live stream binds loopback or ipc:// only, unless this says otherwise.
    log_pub_allow_remote: bool = False

    def __attrs_post_init__(self) -> None:
        _validate(self)


@attrs.frozen(kw_only=True)
class Settings:
    """Every lazy-offload key of ``kv_connector_extra_config``, validated."""

    offload: OffloadConfig = attrs.Factory(OffloadConfig)
    shell: ShellConfig = attrs.Factory(ShellConfig)

    def to_wire(self) -> dict[str, object]:
        """A plain dict keyed by the full config keys, in the key table's
        order, for log headers."""
        wire: dict[str, object] = {}
        for key, (record, name, _) in _KEYS.items():
            value = getattr(getattr(self, record), name)
            if isinstance(value, Policy):
                value = value.value
            wire[key] = "" if value is None else value
        return wire


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


def _endpoint(key: str, value: object) -> str:
    if isinstance(value, str) and (value == "" or "://" in value):
        return value
    raise ConfigError(key, value, 'a ZeroMQ endpoint such as "tcp://127.0.0.1:5600", or ""')


def _at_least(minimum: float, *, inclusive: bool) -> Callable[[str, object], float]:
    return lambda key, value: _finite_float(key, value, minimum=minimum, inclusive=inclusive)


# The hand-off budget's floor: a snapshot of a full stored-key memory
# (STORED_KEYS_MAX keys) is 2.25 MiB, and a START that ends an outage must fit.
LOG_BUDGET_MIN_MIB: Final = 4.0


def _log_budget(key: str, value: object) -> float:
    allowed = (f"a finite number >= {LOG_BUDGET_MIN_MIB:g} (MiB; a snapshot of a full state, "
               "up to 2.25 MiB, must fit)")
    try:
        return _finite_float(key, value, minimum=LOG_BUDGET_MIN_MIB, inclusive=True)
    except ConfigError:
        raise ConfigError(key, value, allowed) from None


# Every key: the record that holds it ("offload": the core's OffloadConfig,
# "shell": the connector's ShellConfig), its field, and its parser. The order
# is the log header's.
_KEYS: Final[dict[str, tuple[str, str, Callable[[str, object], object]]]] = {
    PREFIX: ("shell", "enabled", _bool),
    f"{PREFIX}_policy": ("offload", "policy", _policy),
    f"{PREFIX}_threshold": ("offload", "threshold", _positive_int),
    f"{PREFIX}_select_count": ("offload", "select_count", _positive_int),
    f"{PREFIX}_horizon_steps": ("offload", "horizon_steps", _at_least(0.0, inclusive=False)),
    f"{PREFIX}_max_drain_per_step": ("offload", "max_drain_per_step", _positive_int),
    f"{PREFIX}_max_deferral_seconds": (
        "offload", "max_deferral_seconds", _at_least(0.0, inclusive=True)),
    f"{PREFIX}_log_dir": ("shell", "log_dir", _log_dir),
    f"{PREFIX}_log_pub_endpoint": ("shell", "log_pub_endpoint", _endpoint),
    f"{PREFIX}_receipt_lease_s": ("offload", "receipt_lease_s", _at_least(0.0, inclusive=True)),
    f"{PREFIX}_log_max_total_mib": (
        "shell", "log_max_total_mib", _at_least(0.0, inclusive=False)),
    f"{PREFIX}_log_max_file_mib": ("shell", "log_max_file_mib", _at_least(0.0, inclusive=False)),
    f"{PREFIX}_idle_flush_steps": ("offload", "idle_flush_steps", _count),
    f"{PREFIX}_shutdown_flush_s": ("offload", "shutdown_flush_s", _at_least(0.0, inclusive=True)),
    f"{PREFIX}_chunk_split": ("offload", "chunk_split", _bool),
    f"{PREFIX}_cascade_lookahead_blocks": (
        "offload", "cascade_lookahead_blocks",
        lambda k, v: _integer(k, v, minimum=0, allowed="an integer >= 0 (0: read once a round)")),
    f"{PREFIX}_log_budget_mib": ("shell", "log_budget_mib", _log_budget),
    f"{PREFIX}_log_pub_allow_remote": ("shell", "log_pub_allow_remote", _bool),
}

# Keys a log header may lack because it was recorded before they existed: the
# value that reproduces the recorder's behaviour then.
_BEFORE_THEY_EXISTED: dict[str, object] = {
    f"{PREFIX}_receipt_lease_s": 0.0,
    f"{PREFIX}_idle_flush_steps": 0,
    f"{PREFIX}_shutdown_flush_s": 0.0,
    f"{PREFIX}_chunk_split": False,
    f"{PREFIX}_cascade_lookahead_blocks": 0,
}

KNOWN_KEYS: tuple[str, ...] = tuple(_KEYS)
_RECORDS: Final = {"offload": OffloadConfig, "shell": ShellConfig}


def _validate(config: OffloadConfig | ShellConfig) -> None:
    """A record built directly is checked as :func:`parse_config` checks its
    keys, and must already hold typed values (no strings for numbers); the
    :class:`ConfigError` names the field (``parse_config`` names the key)."""
    record = "offload" if isinstance(config, OffloadConfig) else "shell"
    for owner, name, parse in _KEYS.values():
        if owner != record:
            continue
        value = getattr(config, name)
        parsed = parse(name, value)
        exact = type(parsed) is type(value) or (type(parsed) is float and type(value) is int)
        if parsed != value or not exact:
            kind = type(parsed).__name__
            raise ConfigError(name, value, f"a value of type {kind} (parse_config takes"
                              " strings; the config records take typed values)")
    if not isinstance(config, ShellConfig):
        return
    if config.log_max_file_mib > config.log_max_total_mib:
        raise ConfigError("log_max_file_mib", config.log_max_file_mib,
                          f"at most {PREFIX}_log_max_total_mib ({config.log_max_total_mib:g}):"
                          " a file is never deleted while it is written")
    endpoint = config.log_pub_endpoint
    if endpoint and not config.log_pub_allow_remote and not is_local_endpoint(endpoint):
        raise ConfigError("log_pub_endpoint", endpoint,
                          "a loopback endpoint (tcp://127.0.0.1:PORT, tcp://[::1]:PORT, "
                          "tcp://localhost:PORT) or ipc://PATH: the stream has no "
                          "authentication; to publish on this address anyway set "
                          f"{PREFIX}_log_pub_allow_remote to true")


def engine_endpoint(endpoint: str, engine_index: int) -> str:
    """The live stream's endpoint for one engine: ``{engine}`` in the key's
    value becomes the engine index (``ipc:///run/lazy-offload-{engine}.sock``);
    without it, a ``tcp://`` endpoint's port is offset by the index (engine 1
    of ``tcp://127.0.0.1:5600`` binds 5601), so engines sharing the key never
    contend for one address."""
    if "{engine}" in endpoint:
        return endpoint.replace("{engine}", str(engine_index))
    host, sep, port = endpoint.rpartition(":")
    if engine_index and endpoint.startswith("tcp://") and sep and port.isdigit():
        return f"{host}:{int(port) + engine_index}"
    return endpoint


def is_local_endpoint(endpoint: str) -> bool:
    """Whether a ZeroMQ endpoint is reachable from this host only: ``ipc://``,
    or ``tcp://`` on a loopback address."""
    if endpoint.startswith("ipc://"):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://"):].rpartition(":")[0]
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if host in ("localhost", "::1"):
        return True
    parts = host.split(".")
    return (len(parts) == 4 and parts[0] == "127"
            and all(part.isdigit() and int(part) < 256 for part in parts))


def parse_config(extra_config: Mapping[str, object]) -> Settings:
    """Parse the lazy-offload keys of ``kv_connector_extra_config``.

    Keys outside the ``lmcache.mp.lazy_offload`` family are ignored (they belong
    to LMCache's connector). Raises :class:`ConfigError` on the first bad key.
    """
    fields: dict[str, dict[str, object]] = {"offload": {}, "shell": {}}
    for key, value in extra_config.items():
        if not key.startswith(PREFIX):
            continue
        if key not in _KEYS:
            close = difflib.get_close_matches(key, KNOWN_KEYS, n=1, cutoff=0.0)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(key, value, f"a known key ({', '.join(KNOWN_KEYS)}){hint}")
        record, name, parse = _KEYS[key]
        fields[record][name] = parse(key, value)
    try:
        return Settings(offload=OffloadConfig(**fields["offload"]),  # type: ignore[arg-type]
                        shell=ShellConfig(**fields["shell"]))  # type: ignore[arg-type]
    except ConfigError as error:  # a check across fields (_validate): name the key
        key = next((k for k, (_, name, _) in _KEYS.items() if name == error.key), error.key)
        raise ConfigError(key, error.value, error.allowed) from None


def parse_recorded_config(wire: Mapping[str, object]) -> Settings:
    """The settings of a log header (``Settings.to_wire``); keys added after
    the log was recorded take the values it was recorded under."""
    return parse_config({**_BEFORE_THEY_EXISTED, **wire})
