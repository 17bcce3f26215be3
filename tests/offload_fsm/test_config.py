"""Configuration parsing: spec defaults, accepted spellings, and one
ConfigError naming key, value and what is allowed for every bad input."""

from __future__ import annotations

import math

import attrs
import pytest

from offload_fsm import ConfigError, OffloadConfig, Policy, Settings, ShellConfig, parse_config

P = "lmcache.mp.lazy_offload"


def core(extra: dict[str, object]) -> OffloadConfig:
    """The core's record of what ``extra`` parses to."""
    return parse_config(extra).offload


def test_defaults_match_the_spec() -> None:
    settings = parse_config({})
    assert settings == Settings(offload=OffloadConfig(), shell=ShellConfig())
    assert settings.shell.enabled is False
    config = settings.offload
    assert config.policy is Policy.EVICTION_AWARE
    assert config.threshold == 100
    assert config.select_count == 10
    assert config.horizon_steps == 2.5
    assert config.max_drain_per_step == 64
    assert config.max_deferral_seconds == 0.0


def test_spec_example_enables_fifo_20_10() -> None:
    settings = parse_config({
        "lmcache.mp.host": "localhost",
        "lmcache.mp.port": 5555,
        f"{P}": True,
        f"{P}_policy": "FIFO",
        f"{P}_threshold": 20,
        f"{P}_select_count": 10,
    })
    config = settings.offload
    assert (settings.shell.enabled, config.policy, config.threshold, config.select_count) == (
        True, Policy.FIFO, 20, 10)


def test_native_and_json_string_numbers_give_equal_configs() -> None:
    native = core({
        f"{P}_horizon_steps": 4.0, f"{P}_max_drain_per_step": 8,
        f"{P}_max_deferral_seconds": 1.5, f"{P}_threshold": 20, f"{P}_select_count": 3,
    })
    strings = core({
        f"{P}_horizon_steps": "4", f"{P}_max_drain_per_step": "8",
        f"{P}_max_deferral_seconds": "1.5", f"{P}_threshold": "20", f"{P}_select_count": "3",
    })
    assert native == strings
    assert (native.horizon_steps, native.max_drain_per_step, native.max_deferral_seconds) == (
        4.0, 8, 1.5)


def test_integral_float_is_accepted_for_a_count() -> None:
    assert core({f"{P}_threshold": 8.0}).threshold == 8


def test_zero_deferral_is_allowed() -> None:
    assert core({f"{P}_max_deferral_seconds": 0}).max_deferral_seconds == 0.0


def test_policy_names() -> None:
    assert core({f"{P}_policy": "EVICTION_AWARE"}).policy is Policy.EVICTION_AWARE
    assert core({f"{P}_policy": "FIFO"}).policy is Policy.FIFO


def test_keys_outside_the_family_are_ignored() -> None:
    config = parse_config({
        "lmcache.mp.host": "localhost",
        "lmcache.mp.port": "not even a number",
        "lmcache.mp.lazy": "x",  # not the lazy_offload family
        "something_else": object(),
    })
    assert config == Settings()


BAD = [
    # key suffix, value, words of the allowed text
    ("_threshold", 0, "integer >= 1"),
    ("_threshold", -5, "integer >= 1"),
    ("_select_count", 0, "integer >= 1"),
    ("_select_count", "-1", "integer >= 1"),
    ("_max_drain_per_step", 0, "integer >= 1"),
    ("_max_drain_per_step", 8.9, "integer >= 1"),
    ("_max_drain_per_step", "8.9", "integer >= 1"),
    ("_threshold", 8.9, "integer >= 1"),
    ("_select_count", True, "integer >= 1"),
    ("_threshold", "twenty", "integer >= 1"),
    ("_threshold", math.inf, "integer >= 1"),
    ("_max_drain_per_step", "inf", "integer >= 1"),
    ("_select_count", math.nan, "integer >= 1"),
    ("_horizon_steps", 0, "finite number > 0"),
    ("_horizon_steps", -1.0, "finite number > 0"),
    ("_horizon_steps", math.nan, "finite number > 0"),
    ("_horizon_steps", "nan", "finite number > 0"),
    ("_horizon_steps", math.inf, "finite number > 0"),
    ("_horizon_steps", "inf", "finite number > 0"),
    ("_horizon_steps", "2.5 steps", "finite number > 0"),
    ("_horizon_steps", None, "finite number > 0"),
    ("_max_deferral_seconds", -0.5, "finite number >= 0"),
    ("_max_deferral_seconds", "-inf", "finite number >= 0"),
    ("_max_deferral_seconds", math.nan, "finite number >= 0"),
    ("", "true", "JSON boolean"),
    ("", "false", "JSON boolean"),
    ("", 1, "JSON boolean"),
    ("", None, "JSON boolean"),
    ("_policy", "LRU", "one of EVICTION_AWARE, FIFO"),
    ("_policy", "", "one of EVICTION_AWARE, FIFO"),
    ("_policy", 1, "one of EVICTION_AWARE, FIFO"),
    ("_idle_flush_steps", -1, "an integer >= 0"),
    ("_idle_flush_steps", 2.5, "an integer >= 0"),
    ("_idle_flush_steps", "true", "an integer >= 0"),
    ("_idle_flush_steps", True, "an integer >= 0"),
    ("_idle_flush_steps", math.nan, "an integer >= 0"),
    ("_shutdown_flush_s", -0.5, "a finite number >= 0"),
    ("_shutdown_flush_s", math.inf, "a finite number >= 0"),
    ("_shutdown_flush_s", "soon", "a finite number >= 0"),
    ("_shutdown_flush_s", False, "a finite number >= 0"),
]


@pytest.mark.parametrize(("suffix", "value", "allowed"), BAD)
def test_bad_value_raises_config_error_naming_key_value_and_allowed(
    suffix: str, value: object, allowed: str
) -> None:
    key = P + suffix
    with pytest.raises(ConfigError) as raised:
        parse_config({key: value})
    error = raised.value
    assert error.key == key
    assert error.value is value or error.value == value
    assert allowed in error.allowed
    message = str(error)
    assert key in message and repr(value) in message and allowed in message


@pytest.mark.parametrize(
    ("typo", "suggestion"),
    [
        (f"{P}_max_drain_per_stp", f"{P}_max_drain_per_step"),
        (f"{P}_treshold", f"{P}_threshold"),
        (f"{P}_selectcount", f"{P}_select_count"),
        (f"{P}_horizon", f"{P}_horizon_steps"),
        (f"{P}_polcy", f"{P}_policy"),
        (f"{P}_max_deferal_seconds", f"{P}_max_deferral_seconds"),
    ],
)
def test_unknown_key_in_the_family_suggests_the_closest_key(typo: str, suggestion: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config({typo: 8})
    error = raised.value
    assert error.key == typo and error.value == 8
    assert f"did you mean {suggestion!r}?" in str(error)


def test_upstream_g2_key_is_rejected_not_silently_ignored() -> None:
    with pytest.raises(ConfigError, match="min_prefix_tokens"):
        parse_config({f"{P}_min_prefix_tokens": 0})


def test_config_error_is_a_value_error() -> None:
    assert issubclass(ConfigError, ValueError)


def test_unicode_digit_string_for_a_count_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config({f"{P}_threshold": "²"})
    assert raised.value.key == f"{P}_threshold"


# --------------------------------------------------------------------------
# Disk use of the event log.


def test_log_disk_bounds_default_to_1024_and_64_mib() -> None:
    shell = parse_config({}).shell
    assert (shell.log_max_total_mib, shell.log_max_file_mib) == (1024.0, 64.0)


def test_log_disk_bounds_accept_numbers_and_numeric_strings() -> None:
    settings = parse_config({f"{P}_log_max_total_mib": "0.5", f"{P}_log_max_file_mib": 0.125})
    assert (settings.shell.log_max_total_mib, settings.shell.log_max_file_mib) == (0.5, 0.125)
    wire = settings.to_wire()
    assert (wire[f"{P}_log_max_total_mib"], wire[f"{P}_log_max_file_mib"]) == (0.5, 0.125)


@pytest.mark.parametrize("suffix", ["_log_max_total_mib", "_log_max_file_mib"])
@pytest.mark.parametrize("value", [0, -1, math.nan, math.inf, "lots", True, None])
def test_bad_log_disk_bounds_name_key_value_and_allowed(suffix: str, value: object) -> None:
    key = P + suffix
    with pytest.raises(ConfigError) as raised:
        parse_config({key: value})
    assert raised.value.key == key
    assert "finite number > 0" in str(raised.value) and key in str(raised.value)


def test_a_file_bound_above_the_total_is_refused() -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config({f"{P}_log_max_total_mib": 32, f"{P}_log_max_file_mib": 64})
    assert raised.value.key == f"{P}_log_max_file_mib"
    assert f"{P}_log_max_total_mib" in str(raised.value)


@pytest.mark.parametrize(
    ("typo", "suggestion"),
    [
        (f"{P}_log_max_total_mb", f"{P}_log_max_total_mib"),
        (f"{P}_log_max_file_mb", f"{P}_log_max_file_mib"),
    ],
)
def test_a_misspelt_log_bound_suggests_the_key(typo: str, suggestion: str) -> None:
    with pytest.raises(ConfigError, match=f"did you mean {suggestion!r}"):
        parse_config({typo: 8})


# -- a config built directly validates itself ------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("horizon_steps", math.nan, "finite number > 0"),
        ("horizon_steps", 0.0, "finite number > 0"),
        ("max_deferral_seconds", math.inf, "finite number >= 0"),
        ("receipt_lease_s", -1.0, "finite number >= 0"),
        ("max_drain_per_step", 0, "integer >= 1"),
        ("threshold", True, "integer >= 1"),
        ("threshold", "8", "a value of type int"),
        ("select_count", 2.0, "a value of type int"),
        ("enabled", 1, "JSON boolean"),
        ("policy", "FIFO", "a value of type Policy"),
        ("log_dir", 7, "directory path"),
        ("log_pub_endpoint", "nowhere", "ZeroMQ endpoint"),
        ("log_max_total_mib", math.nan, "finite number > 0"),
        ("log_max_file_mib", 2048.0, "at most"),
    ],
)
def test_a_config_built_directly_refuses_a_bad_field_by_name(
    field: str, value: object, allowed: str
) -> None:
    record = ShellConfig if field in attrs.fields_dict(ShellConfig) else OffloadConfig
    with pytest.raises(ConfigError) as raised:
        record(**{field: value})  # type: ignore[arg-type]
    assert raised.value.key == field and raised.value.value is value
    assert allowed in str(raised.value)


def test_a_nan_horizon_never_reaches_the_first_token_step() -> None:
    from offload_fsm import new_state
    from offload_fsm.policies.ea_planner import danger_depth

    with pytest.raises(ConfigError, match="horizon_steps"):
        new_state(OffloadConfig(horizon_steps=math.nan), world_size=1)
    with pytest.raises(ValueError):  # what the first token step used to raise
        danger_depth(1.0, 0, math.nan)


def test_a_config_built_directly_keeps_valid_typed_values() -> None:
    config = OffloadConfig(policy=Policy.FIFO, threshold=3, horizon_steps=1)
    shell = ShellConfig(enabled=True, log_dir=None, log_max_total_mib=8.0, log_max_file_mib=8.0)
    assert (config.threshold, config.horizon_steps, shell.log_dir) == (3, 1, None)
    assert attrs.evolve(config, threshold=4).threshold == 4
    with pytest.raises(ConfigError, match="threshold"):
        attrs.evolve(config, threshold=0)


# --------------------------------------------------------------------------
# The tail flush (offload_fsm.rules.tail_flush): off by default.


def test_the_tail_flush_is_off_by_default_and_logs_without_its_keys_replay_with_it_off() -> None:
    from offload_fsm.vocabulary.config import parse_recorded_config

    assert (core({}).idle_flush_steps, core({}).shutdown_flush_s) == (0, 0.0)
    old_header = {k: v for k, v in Settings().to_wire().items() if "flush" not in k}
    recorded = parse_recorded_config(old_header).offload
    assert (recorded.idle_flush_steps, recorded.shutdown_flush_s) == (0, 0.0)


def test_the_tail_flush_keys_accept_numbers_and_numeric_strings() -> None:
    settings = parse_config({f"{P}_idle_flush_steps": "8", f"{P}_shutdown_flush_s": "2.5"})
    config = settings.offload
    assert (config.idle_flush_steps, config.shutdown_flush_s) == (8, 2.5)
    assert core({f"{P}_idle_flush_steps": 0}).idle_flush_steps == 0
    wire = settings.to_wire()
    assert (wire[f"{P}_idle_flush_steps"], wire[f"{P}_shutdown_flush_s"]) == (8, 2.5)




# --------------------------------------------------------------------------
# Chunk-granularity selection (offload_fsm.rules.split): on, except for old logs.


def test_chunk_split_is_on_and_logs_recorded_before_it_replay_with_it_off() -> None:
    from offload_fsm.vocabulary.config import parse_recorded_config

    assert core({}).chunk_split is True
    assert core({f"{P}_chunk_split": False}).chunk_split is False
    wire = Settings().to_wire()
    assert parse_recorded_config(wire).offload.chunk_split is True
    del wire[f"{P}_chunk_split"]
    assert parse_recorded_config(wire).offload.chunk_split is False


def test_cascade_lookahead_is_on_and_logs_recorded_before_it_replay_with_one_read_a_round(
) -> None:
    from offload_fsm.vocabulary.config import parse_recorded_config

    key = f"{P}_cascade_lookahead_blocks"
    assert core({}).cascade_lookahead_blocks == 1024
    assert core({key: "0"}).cascade_lookahead_blocks == 0
    wire = Settings(offload=OffloadConfig(cascade_lookahead_blocks=7)).to_wire()
    assert parse_recorded_config(wire).offload.cascade_lookahead_blocks == 7
    del wire[key]
    assert parse_recorded_config(wire).offload.cascade_lookahead_blocks == 0


@pytest.mark.parametrize("value", [-1, 2.5, "many", True])
def test_a_bad_cascade_lookahead_names_key_value_and_allowed(value: object) -> None:
    key = f"{P}_cascade_lookahead_blocks"
    with pytest.raises(ConfigError) as raised:
        parse_config({key: value})
    assert raised.value.key == key and "an integer >= 0" in str(raised.value)


@pytest.mark.parametrize("value", ["true", 1, None])
def test_a_bad_chunk_split_value_names_key_value_and_allowed(value: object) -> None:
    key = f"{P}_chunk_split"
    with pytest.raises(ConfigError) as raised:
        parse_config({key: value})
    assert raised.value.key == key and "a JSON boolean" in str(raised.value)


# --------------------------------------------------------------------------
# One parser, two records: the core's and the connector's.


def test_the_core_record_holds_only_what_the_core_reads() -> None:
    shell_only = {"enabled", "log_dir", "log_pub_endpoint", "log_max_total_mib",
                  "log_max_file_mib", "log_budget_mib", "log_pub_allow_remote"}
    assert set(attrs.fields_dict(OffloadConfig)) & shell_only == set()
    assert set(attrs.fields_dict(ShellConfig)) == shell_only


def test_a_header_records_every_key_and_parses_back() -> None:
    from offload_fsm.vocabulary.config import KNOWN_KEYS, parse_recorded_config

    settings = parse_config({f"{P}": True, f"{P}_policy": "FIFO", f"{P}_threshold": 7,
                             f"{P}_log_dir": "/var/log/x", f"{P}_log_max_file_mib": 2})
    wire = settings.to_wire()
    assert tuple(wire) == KNOWN_KEYS
    assert parse_recorded_config(wire) == settings


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5600", "tcp://127.9.0.1:1",
                                      "tcp://localhost:5600", "tcp://[::1]:5600",
                                      "ipc:///tmp/lazy-offload.sock", ""])
def test_a_local_stream_endpoint_is_accepted(endpoint: str) -> None:
    assert parse_config({f"{P}_log_pub_endpoint": endpoint}).shell.log_pub_endpoint == endpoint


@pytest.mark.parametrize("endpoint", ["tcp://*:5600", "tcp://0.0.0.0:5600",
                                      "tcp://10.0.0.7:5600", "tcp://example.com:5600",
                                      "tcp://127.0.0.1.evil:5600", "inproc://x", "pgm://x"])
def test_a_remote_stream_endpoint_is_refused_naming_the_opt_in_key(endpoint: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config({f"{P}_log_pub_endpoint": endpoint})
    assert raised.value.key == f"{P}_log_pub_endpoint" and raised.value.value == endpoint
    assert f"{P}_log_pub_allow_remote" in str(raised.value)
    allowed = parse_config({f"{P}_log_pub_endpoint": endpoint,
                            f"{P}_log_pub_allow_remote": True})
    assert allowed.shell.log_pub_endpoint == endpoint


def test_the_hand_off_budget_defaults_to_64_mib_and_refuses_nonsense() -> None:
    assert parse_config({}).shell.log_budget_mib == 64.0
    for value in (0, -1, math.nan, "lots", True, 3.9):
        with pytest.raises(ConfigError, match="log_budget_mib") as refused:
            parse_config({f"{P}_log_budget_mib": value})
        assert "a finite number >= 4 (MiB" in str(refused.value)
    assert parse_config({f"{P}_log_budget_mib": 4}).shell.log_budget_mib == 4.0


def test_each_engine_gets_its_own_stream_endpoint() -> None:
    from offload_fsm.vocabulary.config import engine_endpoint

    assert engine_endpoint("ipc:///run/lo-{engine}.sock", 3) == "ipc:///run/lo-3.sock"
    assert engine_endpoint("tcp://127.0.0.1:56{engine}0", 1) == "tcp://127.0.0.1:5610"
    assert engine_endpoint("tcp://127.0.0.1:5600", 0) == "tcp://127.0.0.1:5600"
    assert engine_endpoint("tcp://127.0.0.1:5600", 2) == "tcp://127.0.0.1:5602"
    assert engine_endpoint("tcp://[::1]:5600", 1) == "tcp://[::1]:5601"
    assert engine_endpoint("", 4) == ""
    parsed = parse_config({f"{P}_log_pub_endpoint": "tcp://127.0.0.1:56{engine}0"})
    assert parsed.shell.log_pub_endpoint == "tcp://127.0.0.1:56{engine}0"
