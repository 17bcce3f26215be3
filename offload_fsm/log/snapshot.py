"""The whole machine state as plain data, and back: what a SNAPSHOT log
record carries so that every log file replays alone. Pure: no clock, no I/O.

Primitives:
  take(state)              a tuple of ints, floats, strings, None and tuples
  restore(data, config)    a :class:`~offload_fsm.state.State` equal to the original
                           (same ``digest.state_digest``, same later outcomes)

How it stays complete
---------------------
The codec is derived from the attrs fields of the state classes and their
resolved annotations, not written by hand, so a field added to ``State``,
``RequestState``, ``Op``, ``Batch`` or ``StepContext`` travels without a
change here (a field of a type this module cannot encode fails at import,
loudly, in every test). Records are positional, and the wire names each
class's fields once (by ``state.WIRE_NAME`` where a field says so: an op's
packed ints travel as the ``block_ids`` and ``block_hashes`` tuples they
pack), so a snapshot written before a field existed decodes with its
default, and one with a field this code does not know is refused
(:class:`LogCorrupt`). Dicts decode into the field's own factory (``counters``
starts from ``new_counters``: a counter added later is there, zero).

Identity
--------
``RequestState``, ``Op`` and ``Batch`` objects are shared: ``Op.req``,
``Batch.req`` and ``RequestState.batch`` point at each other, ``pending``
holds the same records as ``requests``, ``owners`` entries are the very ops
in the buffers, and an orphaned batch keeps the request record its id reuse
replaced. Each such object is encoded once, in a table of its class (in the
order the walk first meets it), and every reference is its index there;
decoding allocates every table entry first and fills the fields after, so
the rebuilt graph has the same sharing as the original. Other attrs classes
(``StepContext``) are owned by one field and encoded inline, without names:
their fields are only ever appended (an older record takes the defaults).
``config`` is not encoded (the file header carries it, ``restore`` takes
it), nor is ``state.DERIVED`` (``restore`` rebuilds it).

Wire: ``(SNAPSHOT_FORMAT, names, state, requests, ops, batches)``, ``names``
being ``((class name, (field, ...)), ...)``, each table a tuple of positional
records; a renamed field is mapped (``_RENAMED``). ``State.owners`` has a codec
of its own (format 2, ``log.snapshot_tables``): four flat tuples of ints.
"""

from __future__ import annotations

import enum
import operator
import types
import typing
from collections.abc import Callable
from typing import Any, Final

import attrs

from offload_fsm.log.bounds import check_widths
from offload_fsm.log.snapshot_tables import (
    Decoding,
    Encoding,
    encode_owners,
    owners_decoder,
    packed_ints_codec,
    ref,
    refs,
    wire_names,
)
from offload_fsm.state import DERIVED, Batch, Op, RequestState, State, StepContext, rederive
from offload_fsm.vocabulary.config import OffloadConfig
from offload_fsm.vocabulary.errors import LogCorrupt

__all__ = ["SNAPSHOT_FORMAT", "encode_records", "names", "restore", "take"]

SNAPSHOT_FORMAT: Final = 2
"""Bumped only if the layout above changes (2: ``State.owners`` flat)."""
_FORMATS: Final = frozenset((1, SNAPSHOT_FORMAT))

_SHARED: Final[tuple[type[Any], ...]] = (RequestState, Op, Batch)
_INLINE: Final[tuple[type[Any], ...]] = (StepContext,)
_SKIPPED: Final = {State: frozenset({"config"}) | DERIVED}

Encode = Callable[[Any, Encoding], Any]
Decode = Callable[[Any, Decoding], Any]


def _identity(value: Any, _: Any) -> Any:
    return value


_PRIMITIVES: Final = (int, float, str, bool, type(None))


def _codec(tp: Any, where: str) -> tuple[Encode | None, Decode | None]:
    """Encoder and decoder for values of type ``tp`` (None: the value is its
    own wire form)."""
    if tp is None:
        tp = type(None)
    if tp in _PRIMITIVES or tp is typing.Any:
        return None, None
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        enum_type = tp
        return (lambda v, _: v.value), (lambda v, _: enum_type(v))
    if tp in _SHARED:
        shared = tp
        return ref, (lambda v, dec: dec.tables[shared][v])
    if tp in _INLINE:
        record = _record(tp)
        return record.encode, record.decode
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return _union(args, where)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            enc, dec = _codec(args[0], where)
            if enc is None and dec is None:
                return (lambda v, _: tuple(v)), (lambda v, _: tuple(v))
            return _sequence(enc or _identity, dec or _identity, tuple)
        codecs = [_codec(arg, where) for arg in args]
        if all(e is None and d is None for e, d in codecs):
            return (lambda v, _: tuple(v)), (lambda v, _: tuple(v))
        encs = [e or _identity for e, _ in codecs]
        decs = [d or _identity for _, d in codecs]
        return ((lambda v, c: tuple(e(x, c) for e, x in zip(encs, v, strict=True))),
                (lambda v, c: tuple(d(x, c) for d, x in zip(decs, v, strict=True))))
    if origin is list:
        enc, dec = _codec(args[0], where)
        if enc is ref and dec is not None:
            item_dec = dec
            return refs, (lambda v, c: [item_dec(x, c) for x in v])
        return _sequence(enc or _identity, dec or _identity, list)
    if origin is set:
        enc, dec = _codec(args[0], where)
        if enc is not None or dec is not None:
            raise TypeError(f"snapshot: {where}: sets of {args[0]!r} are not supported")
        # Sorted: set order is not stable across processes.
        return (lambda v, _: tuple(sorted(v))), (lambda v, _: set(v))
    if origin is dict:
        return _mapping(args, where)
    raise TypeError(f"snapshot: {where}: cannot encode type {tp!r}")


def _sequence(enc: Encode, dec: Decode, kind: type[Any]) -> tuple[Encode, Decode]:
    return ((lambda v, c: tuple([enc(x, c) for x in v])),
            (lambda v, c: kind([dec(x, c) for x in v])))


def _union(args: tuple[Any, ...], where: str) -> tuple[Encode | None, Decode | None]:
    alternatives = [arg for arg in args if arg is not type(None)]
    optional = len(alternatives) < len(args)
    if len(alternatives) == 1:
        enc, dec = _codec(alternatives[0], where)
        if enc is None and dec is None:
            return None, None
        e, d = enc or _identity, dec or _identity
        if not optional:
            return e, d
        return ((lambda v, c: None if v is None else e(v, c)),
                (lambda v, c: None if v is None else d(v, c)))
    codecs = [_codec(arg, where) for arg in alternatives]
    if all(e is None and d is None for e, d in codecs):
        return None, None  # e.g. int | str: msgpack keeps them apart
    # Tagged: ``(alternative index, value)``, the alternative found by runtime type.
    runtime = [typing.get_origin(arg) or arg for arg in alternatives]
    encs = [e or _identity for e, _ in codecs]
    decs = [d or _identity for _, d in codecs]

    first, first_enc = runtime[0], encs[0]

    def encode(value: Any, c: Encoding) -> Any:
        if type(value) is first:
            return (0, first_enc(value, c))
        if value is None:
            return None
        for index, cls in enumerate(runtime):
            if isinstance(value, cls):
                return (index, encs[index](value, c))
        raise TypeError(f"snapshot: {where}: value {value!r} matches no alternative")

    def decode(value: Any, c: Decoding) -> Any:
        if value is None:
            return None
        index, item = value
        return decs[index](item, c)

    return encode, decode


def _mapping(args: tuple[Any, ...], where: str) -> tuple[Encode, Decode]:
    key_enc, key_dec = _codec(args[0], where)
    value_enc, value_dec = _codec(args[1], where)
    ke, kd = key_enc or _identity, key_dec or _identity
    if args[1] in (None, type(None)):  # an ordered set: keys only (C speed for the big ones)
        if key_enc is None and key_dec is None:
            return (lambda v, _: tuple(v)), (lambda v, _: dict.fromkeys(v))
        return ((lambda v, c: tuple([ke(k, c) for k in v])),
                (lambda v, c: dict.fromkeys([kd(k, c) for k in v])))
    if key_enc is None and key_dec is None and value_enc is None and value_dec is None:
        return (lambda v, _: tuple(v.items())), (lambda v, _: dict(v))
    ve, vd = value_enc or _identity, value_dec or _identity
    return ((lambda v, c: tuple([(ke(k, c), ve(x, c)) for k, x in v.items()])),
            (lambda v, c: {kd(k, c): vd(x, c) for k, x in v}))


class _Record:
    """Positional codec of one attrs class, from its fields."""

    def __init__(self, cls: type[Any]) -> None:
        self.cls = cls
        skipped = _SKIPPED.get(cls, frozenset())
        fields = [f for f in attrs.fields(attrs.resolve_types(cls)) if f.name not in skipped]
        self.fields = wire_names(fields)
        self.names: tuple[str, ...] = tuple(self.fields)
        self.getter = operator.attrgetter(*(f.name for f in fields))
        self.encoders: list[tuple[int, Encode]] = []
        self.decoders: dict[str, Decode] = {}
        for index, (name, field) in enumerate(self.fields.items()):
            where = f"{cls.__name__}.{name}"
            enc, dec = _OWN_CODECS.get(where) or _codec(field.type, where)
            if enc is not None:
                self.encoders.append((index, enc))
            if dec is not None:
                self.decoders[name] = dec
        self.dict_fields = frozenset(
            name for name, f in self.fields.items() if typing.get_origin(f.type) is dict
        )
        self._plans: dict[tuple[str, ...], Callable[[Any, Any, Decoding], None]] = {}

    def encode(self, obj: Any, encoding: Encoding) -> tuple[Any, ...]:
        values = self.getter(obj)
        if len(self.names) == 1:
            values = (values,)
        if not self.encoders:
            return tuple(values)
        listed = list(values)
        for index, enc in self.encoders:
            listed[index] = enc(listed[index], encoding)
        return tuple(listed)

    def decode(self, data: Any, decoding: Decoding) -> Any:
        """An inline record (its names are not on the wire). Fields are only
        appended to an inline class, so a shorter record is a record of its
        leading fields, written before the rest existed (they take their
        defaults)."""
        obj = object.__new__(self.cls)
        self.fill(obj, data, self.names[: len(data)], decoding)
        return obj

    def fill(self, obj: Any, data: Any, names: tuple[str, ...], decoding: Decoding) -> None:
        """Set ``obj``'s fields from ``data`` recorded under field ``names``."""
        plan = self.plan(names)
        if len(data) != len(names):
            raise LogCorrupt(f"snapshot: {self.cls.__name__} record has {len(data)} "
                             f"values, expected {len(names)}")
        plan(obj, data, decoding)

    def plan(self, names: tuple[str, ...]) -> Callable[[Any, Any, Decoding], None]:
        """The filler for records written under field ``names`` (cached)."""
        plan = self._plans.get(names)
        if plan is None:
            plan = self._plans[names] = self._make_plan(names)
        return plan

    def _make_plan(self, names: tuple[str, ...]) -> Callable[[Any, Any, Decoding], None]:
        unknown = [name for name in names if name not in self.fields]
        if unknown:
            raise LogCorrupt(f"snapshot: {self.cls.__name__} has no field(s) {unknown}")
        defaults = []
        for name, field in self.fields.items():
            if name in names:
                continue
            if field.default is attrs.NOTHING:
                raise LogCorrupt(f"snapshot: {self.cls.__name__}.{name} is missing and "
                                 "has no default")
            defaults.append((field.name, field.default))
        steps = []
        for name in names:
            field = self.fields[name]
            factory = None
            if name in self.dict_fields and isinstance(field.default, attrs.Factory):  # type: ignore[arg-type]
                factory = field.default.factory
                if factory is dict:
                    factory = None  # nothing to merge into
            steps.append((field.name, self.decoders.get(name), factory))

        def plan(obj: Any, data: Any, decoding: Decoding) -> None:
            for (name, dec, factory), value in zip(steps, data):  # noqa: B905 (checked)
                if dec is not None:
                    value = dec(value, decoding)
                if factory is not None:
                    merged = factory()
                    merged.update(value)
                    value = merged
                object.__setattr__(obj, name, value)
            for name, default in defaults:
                if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
                    default = default.factory()
                object.__setattr__(obj, name, default)

        return plan


_RECORDS: dict[type[Any], _Record] = {}


def _record(cls: type[Any]) -> _Record:
    record = _RECORDS.get(cls)
    if record is None:
        record = _RECORDS[cls] = _Record(cls)
    return record


_OWN_CODECS: Final[dict[str, tuple[Encode, Decode]]] = {
    "State.owners": (encode_owners, owners_decoder(
        _codec(attrs.fields(attrs.resolve_types(State)).owners.type, "State.owners")[1])),
    **{where: packed_ints_codec(where) for where in ("Op.block_ids", "Op.block_hashes")},
}
_TOP: Final[tuple[type[Any], ...]] = (State, *_SHARED)
for _cls in (*_TOP, *_INLINE):
    _record(_cls)  # every field type is checked here, at import

_RENAMED: Final[dict[tuple[str, str], str]] = {("State", "poisoned"): "closed"}

_NAMES: Final = tuple((cls.__name__, _record(cls).names) for cls in _TOP)
_BY_NAME: Final = {cls.__name__: cls for cls in _TOP}


def take(state: State) -> tuple[Any, ...]:
    """The state as nested tuples of plain values (see the module docstring).

    Fresh tuples throughout: the result shares nothing mutable with ``state``,
    so another thread may pack it while the state moves on."""
    encoded: dict[type[Any], list[tuple[Any, ...]]] = {cls: [] for cls in _SHARED}
    body = encode_records(state, lambda cls, row: encoded[cls].append(row))
    return (SNAPSHOT_FORMAT, _NAMES, body, *(tuple(encoded[cls]) for cls in _SHARED))


def encode_records(state: State, emit: Callable[[type[Any], tuple[Any, ...]], None]
                   ) -> tuple[Any, ...]:
    """:func:`take`'s walk: returns the state's own record and hands each
    shared table's records to ``emit(cls, record)``, in table order (the
    tables are ``names()``' classes after ``State``), as they are made; so
    a caller that packs each at once never holds them all
    (``log.snapshot_pack.packed_snapshot``)."""
    encoding = Encoding(_SHARED)
    body: tuple[Any, ...] = _RECORDS[State].encode(state, encoding)
    tables = encoding.tables
    done = dict.fromkeys(_SHARED, 0)
    progress = True
    while progress:  # encoding a record can meet further shared objects
        progress = False
        for cls in _SHARED:
            table, record = tables[cls], _RECORDS[cls]
            while done[cls] < len(table):
                emit(cls, record.encode(table[done[cls]], encoding))
                done[cls] += 1
                progress = True
    return body


def names() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The wire's ``names``: each top class and its fields, ``State`` first."""
    return _NAMES


def restore(data: Any, config: OffloadConfig) -> State:
    """A state rebuilt from :func:`take` output (or its msgpack round trip)
    under ``config``; raises :class:`LogCorrupt` on malformed input."""
    try:
        return _restore(data, config)
    except LogCorrupt:
        raise
    except (TypeError, ValueError, KeyError, IndexError) as error:
        raise LogCorrupt(f"snapshot: {error!r}") from None


def _restore(data: Any, config: OffloadConfig) -> State:
    if len(data) != 3 + len(_SHARED):
        raise LogCorrupt(f"snapshot: {len(data)} parts, expected {3 + len(_SHARED)}")
    version, names, body, *rows = data
    if version not in _FORMATS:
        raise LogCorrupt(f"snapshot format {version!r}, expected one of {sorted(_FORMATS)}")
    recorded = {name: tuple(_RENAMED.get((name, field), field) for field in fields)
                for name, fields in names}
    if set(recorded) != set(_BY_NAME):
        raise LogCorrupt(f"snapshot: classes {sorted(recorded)}, expected {sorted(_BY_NAME)}")
    for cls in _TOP:
        _RECORDS[cls].plan(recorded[cls.__name__])  # refuses unknown fields up front
    for cls, table in zip(_SHARED, rows, strict=True):
        check_widths(cls.__name__, len(recorded[cls.__name__]), table)
    tables = {cls: [object.__new__(cls) for _ in table] for cls, table in
              zip(_SHARED, rows, strict=True)}
    decoding = Decoding(tables, version)
    for cls, table in zip(_SHARED, rows, strict=True):
        record, fields = _RECORDS[cls], recorded[cls.__name__]
        for obj, values in zip(tables[cls], table, strict=True):
            record.fill(obj, values, fields, decoding)
    state: State = object.__new__(State)
    object.__setattr__(state, "config", config)
    _RECORDS[State].fill(state, body, recorded["State"], decoding)
    rederive(state)
    return state
