"""Event-log record format: envelopes around pure domain facts (schema 1).

Pure module: standard library, ``attrs`` and ``msgpack`` only. It turns
records into payload bytes and back; framing (magic, length, CRC32) is
:mod:`offload_fsm.framing`, and files are somebody else's business.

Envelope
--------
Every payload is one msgpack array ``[kind, seq, wall, *payload]``:

==========  ===  =====================================================================
kind        tag  payload
==========  ===  =====================================================================
HEADER      1    ``{...}`` (see :class:`Header`); ``wall`` is absolute seconds
INPUTS      2    ``ev_1, check_1, ev_2, check_2, ...``: consecutive applied events
DIGEST      3    ``digest``: ``codec.state_digest`` after event ``seq`` was applied
GAP         4    ``lost_count``: events lost before ``seq`` (writer overload)
END         5    ``events_total, digest``: clean shutdown (digest ``""`` if unknown)
==========  ===  =====================================================================

Kind tags are never renumbered (append new ones). ``seq`` numbers events from
0 without holes; an INPUTS record carries the events ``seq, seq + 1, ...``
(one connector callback: an observation and the answers of its command loop),
which amortises the envelope and the 12 framing bytes. For non-event kinds
``seq`` is the number of events recorded before the record. ``wall`` is the
recorder's clock (``time.time()``) in whole milliseconds since the file
header's ``created_s``, so decoding needs the header's context
(:class:`LogDecoder`).

An event ``ev_i`` is ``codec.to_wire(event)``. ``check_i`` is
:func:`outcome_check` of what the core returned for it: ``0`` for an empty
outcome, else a CRC32 (never 0) of the packed decisions and commands. It lets
replay detect divergence at a cost of one to five bytes per event. With the
header flag ``full_outcomes`` the check is replaced by the outcome itself,
``[decisions, commands]`` as wire tuples.

Versions
--------
The header's ``schema`` states the version of every record in its file.
Readers refuse versions newer than :data:`SCHEMA_VERSION`
(:class:`SchemaTooNew`) and bring older ones up to date with the chain
:data:`UPCASTERS` (``version -> function`` from plain decoded envelope tuples
of that version to the next), before any object is built. A changed field
list of an event, decision or command is a new schema version plus an
upcaster; tags stay.
"""

from __future__ import annotations

import operator
import threading
import zlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

import attrs
import msgpack

from offload_fsm.codec import _ENUM_FIELDS, _FIELD_NAMES, _TYPES, Message, from_wire
from offload_fsm.errors import LogCorrupt, SchemaTooNew, UnknownTag
from offload_fsm.events import EVENT_TYPES, Event
from offload_fsm.machine import Outcome

__all__ = [
    "END",
    "DIGEST",
    "GAP",
    "HEADER",
    "INPUTS",
    "SCHEMA_VERSION",
    "UPCASTERS",
    "Digest",
    "End",
    "Gap",
    "Header",
    "Inputs",
    "LogDecoder",
    "LogRecord",
    "OutcomeWire",
    "decode_outcome",
    "decode_record",
    "encode_digest",
    "encode_end",
    "encode_gap",
    "encode_header",
    "encode_inputs",
    "encode_record",
    "outcome_check",
    "outcome_wire",
    "wire",
    "wire_check",
]

SCHEMA_VERSION: Final[int] = 1

HEADER: Final[int] = 1
INPUTS: Final[int] = 2
DIGEST: Final[int] = 3
GAP: Final[int] = 4
END: Final[int] = 5

OutcomeWire = tuple[tuple[tuple[Any, ...], ...], tuple[tuple[Any, ...], ...]]

UPCASTERS: dict[int, Callable[[tuple[Any, ...]], tuple[Any, ...]]] = {}
"""``UPCASTERS[n]`` turns a decoded envelope tuple of schema ``n`` into schema
``n + 1``. Empty while only schema 1 exists."""


# --------------------------------------------------------------------------
# Records.


@attrs.frozen(kw_only=True)
class Header:
    """First record of every file: everything needed to replay the run."""

    seq: int  # events recorded before this file
    wall_time_s: float
    schema: int
    config: dict[str, Any]  # OffloadConfig.to_wire()
    policy: str
    world_size: int
    versions: dict[str, str]  # package, vllm, lmcache, ...
    created_s: float
    file_index: int = 0
    digest_every: int = 0
    full_outcomes: bool = False


@attrs.frozen(kw_only=True)
class Inputs:
    """Applied events ``seq, seq + 1, ...`` with their outcome checks (ints)
    or, under ``full_outcomes``, their outcomes (:data:`OutcomeWire`)."""

    seq: int
    wall_time_s: float
    events: tuple[Event, ...]
    checks: tuple[int | OutcomeWire, ...]


@attrs.frozen(kw_only=True)
class Digest:
    seq: int  # the last event applied before the digest was taken
    wall_time_s: float
    digest: str


@attrs.frozen(kw_only=True)
class Gap:
    seq: int  # the first lost event
    wall_time_s: float
    lost_count: int


@attrs.frozen(kw_only=True)
class End:
    seq: int  # events recorded in total
    wall_time_s: float
    events_total: int
    digest: str


LogRecord = Header | Inputs | Digest | Gap | End


# --------------------------------------------------------------------------
# Fast wire conversion (same result as ``codec.to_wire``, without attrs.astuple).


def _make_wire(cls: type[Any]) -> Callable[[Any], tuple[Any, ...]]:
    tag = cls.TAG
    names = _FIELD_NAMES[tag]
    enum_at = tuple(index for index, _ in _ENUM_FIELDS[tag])
    if not names:
        empty = (tag,)
        return lambda message: empty
    get = operator.attrgetter(*names)
    if len(names) == 1:
        if enum_at:
            return lambda message: (tag, getattr(message, names[0]).value)
        return lambda message: (tag, get(message))
    if enum_at:
        def convert(message: Any) -> tuple[Any, ...]:
            values = list(get(message))
            for index in enum_at:
                values[index] = values[index].value
            return (tag, *values)
        return convert
    return lambda message: (tag, *get(message))


_WIRE: dict[type[Any], Callable[[Any], tuple[Any, ...]]] = {
    cls: _make_wire(cls) for cls in _TYPES.values()
}


def wire(message: Message) -> tuple[Any, ...]:
    """``codec.to_wire(message)``, faster."""
    return _WIRE[type(message)](message)


def outcome_wire(outcome: Outcome) -> OutcomeWire:
    table = _WIRE
    return (
        tuple(table[type(d)](d) for d in outcome.decisions),
        tuple(table[type(c)](c) for c in outcome.commands),
    )


_local: Final = threading.local()  # msgpack.Packer is not thread-safe
_crc32: Final = zlib.crc32


def _packb(obj: Any) -> bytes:
    try:
        pack = _local.pack
    except AttributeError:
        pack = _local.pack = msgpack.Packer(use_bin_type=True).pack
    return pack(obj)  # type: ignore[no-any-return]


def outcome_check(outcome: Outcome) -> int:
    """0 for an empty outcome, else a non-zero CRC32 of its packed wire form."""
    if not outcome.decisions and not outcome.commands:
        return 0
    return _crc32(_packb(outcome_wire(outcome))) or 1


def wire_check(value: OutcomeWire) -> int:
    """:func:`outcome_check` of an outcome given in wire form."""
    if not value[0] and not value[1]:
        return 0
    return _crc32(_packb(value)) or 1


# --------------------------------------------------------------------------
# Encoding.


def _ms(wall_time_s: float, created_s: float) -> int:
    return max(0, round((wall_time_s - created_s) * 1000.0))


def encode_header(header: Header) -> bytes:
    body: dict[str, Any] = {
        "schema": header.schema,
        "config": header.config,
        "policy": header.policy,
        "world_size": header.world_size,
        "versions": header.versions,
        "created_s": header.created_s,
        "file_index": header.file_index,
        "digest_every": header.digest_every,
        "full_outcomes": header.full_outcomes,
    }
    return _packb((HEADER, header.seq, header.wall_time_s, body))


def encode_inputs(
    seq: int,
    wall_ms: int,
    applied: Iterable[tuple[Event, Outcome]],
    *,
    full_outcomes: bool = False,
) -> bytes:
    """An INPUTS payload for events numbered from ``seq``; ``wall_ms`` is
    relative to the file header's ``created_s``."""
    table = _WIRE
    items: list[Any] = [INPUTS, seq, wall_ms]
    append = items.append
    for event, outcome in applied:
        append(table[type(event)](event))
        append(outcome_wire(outcome) if full_outcomes else outcome_check(outcome))
    return _packb(items)


def encode_digest(seq: int, wall_ms: int, digest: str) -> bytes:
    return _packb((DIGEST, seq, wall_ms, digest))


def encode_gap(seq: int, wall_ms: int, lost_count: int) -> bytes:
    return _packb((GAP, seq, wall_ms, lost_count))


def encode_end(seq: int, wall_ms: int, events_total: int, digest: str) -> bytes:
    return _packb((END, seq, wall_ms, events_total, digest))


def encode_record(record: LogRecord, *, created_s: float) -> bytes:
    """Any record as a payload; times relative to ``created_s`` (the header's)."""
    if isinstance(record, Header):
        return encode_header(record)
    ms = _ms(record.wall_time_s, created_s)
    if isinstance(record, Inputs):
        items: list[Any] = [INPUTS, record.seq, ms]
        for event, check in zip(record.events, record.checks, strict=True):
            items.append(wire(event))
            items.append(check)
        return _packb(items)
    if isinstance(record, Digest):
        return encode_digest(record.seq, ms, record.digest)
    if isinstance(record, Gap):
        return encode_gap(record.seq, ms, record.lost_count)
    return encode_end(record.seq, ms, record.events_total, record.digest)


# --------------------------------------------------------------------------
# Decoding.


def _make_builder(cls: type[Any]) -> Callable[[Sequence[Any]], Any]:
    """Build ``cls`` from its wire tuple without the attrs ``__init__`` frame.

    Events have no validators, converters, defaults or enum fields, so filling
    the slots directly gives an object equal to ``cls(**fields)``.
    """
    names = _FIELD_NAMES[cls.TAG]
    assert not _ENUM_FIELDS[cls.TAG], f"{cls.__name__} has enum fields"
    setters = tuple(cls.__dict__[name].__set__ for name in names)
    width = len(names) + 1
    new = object.__new__
    if not names:
        def build_empty(item: Sequence[Any]) -> Any:
            if len(item) != 1:
                raise LogCorrupt(f"tag {cls.TAG} ({cls.__name__}) carries fields")
            return new(cls)
        return build_empty

    def build(item: Sequence[Any]) -> Any:
        if len(item) != width:
            raise LogCorrupt(
                f"tag {cls.TAG} ({cls.__name__}) has {len(item) - 1} fields, "
                f"expected {width - 1}"
            )
        obj = new(cls)
        for setter, value in zip(setters, item[1:]):  # noqa: B905 (length checked)
            setter(obj, value)
        return obj

    return build


_EVENT_BUILDERS: dict[int, Callable[[Sequence[Any]], Any]] = {
    cls.TAG: _make_builder(cls) for cls in EVENT_TYPES
}


def _event(item: Any) -> Event:
    try:
        build = _EVENT_BUILDERS[item[0]]
    except KeyError:
        raise UnknownTag(item[0]) from None
    except (TypeError, IndexError):
        raise LogCorrupt(f"expected an event array, got {item!r}") from None
    return build(item)  # type: ignore[no-any-return]


def _upcast(item: tuple[Any, ...], version: int) -> tuple[Any, ...]:
    while version < SCHEMA_VERSION:
        upcaster = UPCASTERS.get(version)
        if upcaster is None:
            raise LogCorrupt(f"no upcaster from schema version {version}")
        item = upcaster(item)
        version += 1
    return item


def _header_version(item: tuple[Any, ...]) -> int:
    body = item[3] if len(item) > 3 else None
    if not isinstance(body, dict) or not isinstance(body.get("schema"), int):
        raise LogCorrupt("header without a schema version")
    version: int = body["schema"]
    if version > SCHEMA_VERSION:
        raise SchemaTooNew(version, SCHEMA_VERSION)
    return version


_unpackb_options: Final = {"raw": False, "use_list": False, "strict_map_key": False}


def decode_record(
    payload: bytes, *, schema: int = SCHEMA_VERSION, created_s: float = 0.0
) -> LogRecord:
    """Decode one payload written under ``schema`` in a file whose header says
    ``created_s``. A header decodes under its own version. Raises
    :class:`UnknownTag`, :class:`SchemaTooNew` or :class:`LogCorrupt`."""
    try:
        item = msgpack.unpackb(payload, **_unpackb_options)
    except Exception as error:  # msgpack raises several unrelated types
        raise LogCorrupt(f"undecodable msgpack: {error}") from None
    if not isinstance(item, tuple) or len(item) < 3:
        raise LogCorrupt(f"expected an envelope array, got {type(item).__name__}")
    if item[0] == HEADER:
        schema = _header_version(item)
    elif schema > SCHEMA_VERSION:
        raise SchemaTooNew(schema, SCHEMA_VERSION)
    if schema != SCHEMA_VERSION:
        item = _upcast(item, schema)
    return _build(item, created_s)


def _build(item: tuple[Any, ...], created_s: float) -> LogRecord:
    kind, seq, wall = item[0], item[1], item[2]
    if not isinstance(seq, int) or not isinstance(wall, int | float):
        raise LogCorrupt(f"bad envelope {item[:3]!r}")
    try:
        if kind == INPUTS:
            rest = item[3:]
            if len(rest) % 2:
                raise LogCorrupt("INPUTS record with an odd number of items")
            events = tuple(map(_event, rest[0::2]))
            return Inputs(seq=seq, wall_time_s=created_s + wall / 1000.0, events=events,
                          checks=rest[1::2])
        if kind == DIGEST:
            (digest,) = item[3:]
            return Digest(seq=seq, wall_time_s=created_s + wall / 1000.0, digest=digest)
        if kind == GAP:
            (lost,) = item[3:]
            return Gap(seq=seq, wall_time_s=created_s + wall / 1000.0, lost_count=lost)
        if kind == END:
            total, digest = item[3:]
            return End(seq=seq, wall_time_s=created_s + wall / 1000.0, events_total=total,
                       digest=digest)
        if kind == HEADER:
            body = item[3]
            return Header(
                seq=seq, wall_time_s=float(wall), schema=body["schema"],
                config=dict(body["config"]), policy=body["policy"],
                world_size=body["world_size"], versions=dict(body["versions"]),
                created_s=float(body["created_s"]), file_index=body.get("file_index", 0),
                digest_every=body.get("digest_every", 0),
                full_outcomes=bool(body.get("full_outcomes", False)),
            )
    except (ValueError, KeyError, TypeError) as error:
        raise LogCorrupt(f"record kind {kind}: {error!r}") from None
    raise UnknownTag(kind)


class LogDecoder:
    """Decodes the payloads of one file in order: the header sets the schema
    version and time base for the records after it."""

    __slots__ = ("schema", "created_s", "header")

    def __init__(self) -> None:
        self.schema = SCHEMA_VERSION
        self.created_s = 0.0
        self.header: Header | None = None

    def decode(self, payload: bytes) -> LogRecord:
        record = decode_record(payload, schema=self.schema, created_s=self.created_s)
        if type(record) is Header:
            self.header = record
            self.schema = record.schema
            self.created_s = record.created_s
        return record


def decode_outcome(value: OutcomeWire) -> tuple[tuple[Message, ...], tuple[Message, ...]]:
    """The decisions and commands of a full-outcome check, as objects."""
    return tuple(map(from_wire, value[0])), tuple(map(from_wire, value[1]))
