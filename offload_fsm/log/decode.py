"""Event-log decoding: payload bytes back into records (see ``log.records``).

Pure module: standard library, ``attrs`` and ``msgpack`` only. A payload
decodes under its file's schema version (a header under its own); older
versions are brought up to date by ``log.records.UPCASTERS`` before any object
is built. Events are built without the attrs ``__init__`` frame (the hot path
of replay); a snapshot's state is decoded when it is used
(``log.snapshot_pack.LazyState``). Every failure is :class:`UnknownTag`,
:class:`SchemaTooNew` or :class:`LogCorrupt`.

:class:`LogDecoder` decodes one file in order and keeps what schema 4's
compact forms need (``log.compact``): the segment's :class:`WireContext` and
zlib stream, reset at a header or a snapshot. After damage (:meth:`LogDecoder.lose`)
a reference or a batch of the same segment raises :class:`LogCorrupt`
rather than decode against records that are gone.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from typing import Any, Final

from offload_fsm.log.batch import Inflater
from offload_fsm.log.bounds import (
    MAX_BATCH_OBJECTS,
    MAX_SNAPSHOT_OBJECTS,
    unpackb,
)
from offload_fsm.log.compact import WireContext
from offload_fsm.log.peek import payload_kind
from offload_fsm.log.records import (
    BATCH,
    DIGEST,
    END,
    GAP,
    HEADER,
    INDEX,
    INPUTS,
    REJECTED,
    SCHEMA_VERSION,
    SNAPSHOT,
    UPCASTERS,
    VANISHED,
    Digest,
    End,
    Gap,
    Header,
    Index,
    Inputs,
    LogRecord,
    Rejected,
    Snapshot,
    Vanished,
)
from offload_fsm.log.snapshot_pack import KeysOf, LazyState
from offload_fsm.log.wire import ENUM_FIELDS, FIELD_NAMES
from offload_fsm.vocabulary.errors import LogCorrupt, SchemaTooNew, UnknownTag
from offload_fsm.vocabulary.events import EVENT_TYPES, Event

__all__ = ["LogDecoder", "build_event"]


def _make_builder(cls: type[Any]) -> Callable[[Sequence[Any]], Any]:
    """Build ``cls`` from its wire tuple without the attrs ``__init__`` frame.

    Events have no validators, converters, defaults or enum fields, so filling
    the slots directly gives an object equal to ``cls(**fields)``.
    """
    names = FIELD_NAMES[cls.TAG]
    assert not ENUM_FIELDS[cls.TAG], f"{cls.__name__} has enum fields"
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


def build_event(item: Any) -> Event:
    """The event of a wire tuple, built without the attrs ``__init__`` frame;
    raises :class:`UnknownTag` or :class:`LogCorrupt`."""
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


def _unpack(payload: bytes) -> tuple[Any, ...]:
    try:
        if len(payload) > MAX_BATCH_OBJECTS and payload_kind(payload) == SNAPSHOT:
            item = unpackb(payload, "a SNAPSHOT record", MAX_SNAPSHOT_OBJECTS)
        else:
            item = unpackb(payload, "a record", MAX_BATCH_OBJECTS)
    except (LogCorrupt, MemoryError):
        raise
    except Exception as error:  # msgpack raises several unrelated types
        raise LogCorrupt(f"undecodable msgpack: {error}") from None
    return _envelope(item)


def _envelope(item: Any) -> tuple[Any, ...]:
    if not isinstance(item, tuple) or len(item) < 3:
        raise LogCorrupt(f"expected an envelope array, got {type(item).__name__}")
    return item


def _decode_item(item: tuple[Any, ...], schema: int, created_s: float,
                 context: WireContext) -> LogRecord:
    if item[0] == HEADER:
        schema = _header_version(item)
    elif schema > SCHEMA_VERSION:
        raise SchemaTooNew(schema, SCHEMA_VERSION)
    elif item[0] == BATCH:
        raise LogCorrupt("a batch inside a batch, or outside a LogDecoder")
    if schema != SCHEMA_VERSION:
        item = _upcast(item, schema)
    return _build(item, created_s, context if schema >= 4 else None)


def _build(item: tuple[Any, ...], created_s: float, context: WireContext | None) -> LogRecord:
    kind, seq, wall = item[0], item[1], item[2]
    if not isinstance(seq, int) or not isinstance(wall, int | float):
        raise LogCorrupt(f"bad envelope {item[:3]!r}")
    try:
        if kind == INPUTS:
            rest = item[3:]
            if len(rest) % 2:
                raise LogCorrupt("INPUTS record with an odd number of items")
            wires = rest[0::2]
            if context is not None:
                wires = tuple(map(context.expand, wires))
            events = tuple(map(build_event, wires))
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
        if kind == VANISHED:
            total, reason = item[3:]
            return Vanished(seq=seq, wall_time_s=created_s + wall / 1000.0,
                            events_total=total, reason=reason)
        if kind == REJECTED:
            event, reason = item[3:]
            return Rejected(seq=seq, wall_time_s=created_s + wall / 1000.0,
                            event=build_event(event), reason=reason)
        if kind == SNAPSHOT:
            digest, state = item[3:]
            if isinstance(state, bytes) and context is None:  # before schema 4; later: lazily
                state = _inflated_state(state)
            if not isinstance(digest, str) or not isinstance(state, tuple | bytes):
                raise LogCorrupt("SNAPSHOT record without a digest and a state")
            return Snapshot(seq=seq, wall_time_s=created_s + wall / 1000.0, digest=digest,
                            state=state)
        if kind == INDEX:
            first_step, end_seq, end_step, requests, *key = item[3:]
            if len(key) > 1 or (key and key[0] is not None and type(key[0]) is not int):
                raise LogCorrupt(f"INDEX record with a segment key of {key!r}")
            return Index(seq=seq, wall_time_s=created_s + wall / 1000.0,
                         first_step=first_step, end_seq=end_seq, end_step=end_step,
                         requests=requests, key=key[0] if key else None)
        if kind == HEADER:
            return _header(seq, wall, item[3])
    except (ValueError, KeyError, TypeError) as error:
        raise LogCorrupt(f"record kind {kind}: {error!r}") from None
    raise UnknownTag(kind)


MAX_INFLATED_STATE_BYTES: Final[int] = 512 * 1024 * 1024
"""The most a SNAPSHOT's deflated state may inflate to, whatever it claims."""
MAX_STATE_RATIO: Final[int] = 64
"""The most a state inflates per deflated byte: a real state is ints and ids,
a few times its deflated size; a zip bomb is a thousand."""


def inflate_bound(deflated_bytes: int) -> int:
    """The most a deflated state of ``deflated_bytes`` may inflate to."""
    return min(MAX_INFLATED_STATE_BYTES, max(1 << 20, MAX_STATE_RATIO * deflated_bytes))


def _inflated_state(data: bytes) -> Any:
    """A SNAPSHOT's deflated state, inflated within :func:`inflate_bound`
    (:class:`LogCorrupt` past it: a hostile file cannot make the reader
    allocate more than that)."""
    bound = inflate_bound(len(data))
    stream = zlib.decompressobj()
    try:
        raw = stream.decompress(data, bound)
    except zlib.error as error:
        raise LogCorrupt(f"SNAPSHOT state does not inflate: {error}") from None
    if stream.unconsumed_tail:
        raise LogCorrupt(f"SNAPSHOT state inflates past {bound} bytes "
                         f"({len(data)} deflated)")
    if not stream.eof:
        raise LogCorrupt(f"SNAPSHOT state: its zlib stream is cut short ({len(data)} "
                         "bytes deflated)")
    if stream.unused_data:
        raise LogCorrupt(f"SNAPSHOT state: {len(stream.unused_data)} bytes after its zlib "
                         f"stream ({len(data)} bytes deflated; a state is one stream)")
    try:
        return unpackb(raw, "a SNAPSHOT state", MAX_SNAPSHOT_OBJECTS)
    except (LogCorrupt, MemoryError):
        raise
    except Exception as error:  # msgpack raises several unrelated types
        raise LogCorrupt(f"SNAPSHOT state does not decode: {error}") from None


def _header(seq: int, wall: float, body: dict[str, Any]) -> Header:
    return Header(
        seq=seq, wall_time_s=float(wall), schema=body["schema"],
        config=dict(body["config"]), policy=body["policy"],
        world_size=body["world_size"], versions=dict(body["versions"]),
        created_s=float(body["created_s"]), file_index=body.get("file_index", 0),
        engine_index=body.get("engine_index", 0),
        digest_every=body.get("digest_every", 0),
        full_outcomes=bool(body.get("full_outcomes", False)),
    )


class LogDecoder:
    """Decodes the payloads of one file in order: the header sets the schema
    version and time base for the records after it; a header or a snapshot
    starts a segment (see the module docstring)."""

    __slots__ = ("schema", "created_s", "header", "context", "inflater", "keys")

    def __init__(self) -> None:
        self.schema = SCHEMA_VERSION
        self.created_s = 0.0
        self.header: Header | None = None
        self.context = WireContext()
        self.inflater = Inflater()
        self.keys: LazyState | KeysOf | None = None  # the file's last snapshot's (stored keys)

    def lose(self) -> None:
        """Records were lost (damage): the segment's references are broken."""
        self.context.lose()

    def decode(self, payload: bytes) -> LogRecord:
        """One record; a BATCH payload must hold exactly one (see :meth:`decode_all`)."""
        records = self.decode_all(payload)
        if len(records) != 1:
            raise LogCorrupt(f"expected one record, the batch holds {len(records)}")
        return records[0]

    def decode_all(self, payload: bytes) -> list[LogRecord]:
        """The records of one payload: itself, or a BATCH's in order."""
        item = _unpack(payload)
        if item[0] != BATCH or self.schema < 4:
            self.context.allowance.renew()
            return [self._one(item)]
        if not self.context.intact:
            raise LogCorrupt("a batch after records of its segment were lost")
        self.context.allowance.renew()
        try:
            (data,) = item[3:]
            inner = self.inflater.items(data)
        except (ValueError, TypeError) as error:
            self.lose()
            raise LogCorrupt(f"bad batch: {error!r}") from None
        except LogCorrupt:
            self.lose()
            raise
        out = []
        for each in inner:
            try:
                out.append(self._one(_envelope(each)))
            except LogCorrupt:
                self.lose()
                raise
        return out

    def _one(self, item: tuple[Any, ...]) -> LogRecord:
        record = _decode_item(item, self.schema, self.created_s, self.context)
        kind = type(record)
        if kind is Header:
            assert isinstance(record, Header)
            self.header = record
            self.schema = record.schema
            self.created_s = record.created_s
            self.context.reset()
            self.inflater.reset()
            self.keys = None
        elif kind is Snapshot:
            assert isinstance(record, Snapshot)
            self.context.reset()
            self.inflater.reset()
            if self.schema >= 4:
                self.keys = state = LazyState(record.state, self.keys, _inflated_state)
                record = Snapshot(seq=record.seq, wall_time_s=record.wall_time_s,
                                  digest=record.digest, state=state)
        return record

