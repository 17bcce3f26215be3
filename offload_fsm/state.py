"""The machine's state: plain records, no logic.

Only ``machine.step`` writes these objects, through the transition modules it
calls (it owns them linearly: a state is handed to ``step``, which updates it
in place and returns what it decided; the caller never mutates it).
Everything else (the planners, ``invariants``, ``digest.state_digest``, the
replay tool, ``queries``) only reads.

Iteration order is always insertion order of dicts or explicit sort keys; no
raw set is iterated where order can reach a decision.
"""

from __future__ import annotations

import enum
import functools
import struct
from array import array
from collections import deque
from collections.abc import Iterable
from typing import Final

import attrs

from offload_fsm.vocabulary.config import OffloadConfig
from offload_fsm.vocabulary.counters import Counter, new_counters
from offload_fsm.vocabulary.events import BlockHash

STORED_KEYS_MAX: Final = 1 << 18  # bound of the stored-content memory (EA dedup)
WIRE_NAME: Final = "wire_name"  # a field's metadata key: its name in snapshots, if not its own


PACKED_INT_BYTES: Final = 8  # one value's bytes in a packed sequence (pack_ints)
_PACKED_INT: Final = "q"  # its struct and array type code: signed, native byte order


def pack_ints(values: Iterable[int]) -> bytes:
    """``values`` as 64-bit signed integers in native byte order: raises
    ``TypeError`` for a value that is not an int, ``OverflowError`` for one
    out of range."""
    return array(_PACKED_INT, values).tobytes()


def unpack_ints(packed: bytes) -> tuple[int, ...]:
    """The inverse of :func:`pack_ints`."""
    return struct.unpack(f"{len(packed) // PACKED_INT_BYTES}{_PACKED_INT}", packed)


@functools.lru_cache(maxsize=256)
def _every_nth(step: int, count: int) -> struct.Struct:
    """Reads the last of each ``step`` packed ints, ``count`` times, skipping the rest."""
    return struct.Struct(f"{(step - 1) * PACKED_INT_BYTES}x{_PACKED_INT}" * count)


class Phase(enum.Enum):
    ACTIVE = "active"
    FINISHED = "finished"


class OpStatus(enum.Enum):
    """Where a store op is in its lifecycle (legal moves: ``legality.OP_MOVES``)."""

    BUFFERED = "buffered"  # in its request's buffer (pinned if shielded)
    VERIFYING = "verifying"  # in a batch whose hashes are being re-read
    IN_FLIGHT = "in_flight"  # submitted, awaiting every worker's receipt
    STORED = "stored"
    FAILED = "failed"
    DROPPED = "dropped"
    ABANDONED = "abandoned"  # in flight at shutdown

    # Keys hot tables: Enum's __hash__ runs in Python; members are singletons,
    # so the C identity hash is equivalent (and much faster).
    __hash__ = object.__hash__


LIVE: Final = (OpStatus.BUFFERED, OpStatus.VERIFYING, OpStatus.IN_FLIGHT)
"""The statuses of ops still in the machine (the ledger's live terms)."""


class BatchStatus(enum.Enum):
    VERIFYING = "verifying"  # protected, hashes requested, not yet submitted
    IN_FLIGHT = "in_flight"  # submitted, awaiting receipts from every worker


class PackedBlocks:
    """Block ids and their hashes held packed (:func:`pack_ints`), read as tuples."""

    __slots__ = ()
    packed_ids: bytes
    packed_hashes: bytes

    @property
    def block_ids(self) -> tuple[int, ...]:
        return unpack_ints(self.packed_ids)

    @property
    def block_hashes(self) -> tuple[int, ...]:
        return unpack_ints(self.packed_hashes)

    @property
    def num_blocks(self) -> int:
        return len(self.packed_ids) // PACKED_INT_BYTES


@attrs.define(slots=True, eq=False)
class Op(PackedBlocks):
    """One buffered store operation: a chunk-aligned token range of a request.

    Its block ids and their hashes (never None: an op is admitted only with
    every block hashed) are held packed (:func:`pack_ints`), not as tuples:
    a buffered op can wait for thousands of steps, and while a tuple is one
    more object for the cyclic GC to count towards its next young collection,
    ``bytes`` are not tracked at all. :attr:`block_ids` and
    :attr:`block_hashes` read them as tuples; snapshots carry the tuples too,
    under those names."""

    op_id: int
    req: RequestState
    start_token: int
    end_token: int
    packed_ids: bytes = attrs.field(metadata={WIRE_NAME: "block_ids"})
    packed_hashes: bytes = attrs.field(metadata={WIRE_NAME: "block_hashes"})
    time_s: float
    blocks_per_chunk: int = 0
    pinned: bool = False
    status: OpStatus = OpStatus.BUFFERED

    @property
    def tokens(self) -> int:
        return self.end_token - self.start_token

    @property
    def chunk_keys(self) -> tuple[int, ...]:
        """Each chunk's content key: the hash of its last block. vLLM block hashes
        chain their parents, so it names the whole token prefix the chunk ends,
        which is how LMCache keys the chunk too."""
        step, hashes = self.blocks_per_chunk, self.packed_hashes
        if not step:
            return struct.unpack_from(_PACKED_INT, hashes, len(hashes) - PACKED_INT_BYTES)
        return _every_nth(step, len(hashes) // (step * PACKED_INT_BYTES)).unpack_from(hashes)


@attrs.define(slots=True, eq=False)
class Batch:
    """One request's selected ops, coalesced into one store."""

    batch_id: int
    req: RequestState
    ops: list[Op]
    status: BatchStatus = BatchStatus.VERIFYING
    receipts: int = 0
    failed: bool = False
    orphaned: bool = False
    selected_step: int = 0  # token step it was selected in (pin lifetime)
    selected_time_s: float = 0.0  # when it was selected (the receipt lease)


@attrs.define(slots=True, eq=False)
class RequestState:
    """Per request id. ``ops`` are the buffered ops in token order."""

    req_id: str
    phase: Phase = Phase.ACTIVE
    ops: list[Op] = attrs.Factory(list)
    batch: Batch | None = None
    broken: bool = False
    next_start_token: int | None = None  # end of the last offered range
    order: int = 0  # admission order of the current pending run (tie-break)
    stray_receipts: int = 0  # receipts still due for a batch abandoned at its lease


class Holders(PackedBlocks, dict[int, Op]):
    """A ``State.owners`` entry that the blocks of a run of whole chunks share
    (``block_ids``, in op order, and their snapshot ``block_hashes``, as
    ``owner_hashes`` holds them): every op holding one of them holds them
    all, so an op joining or leaving the run is one dict update, not one per
    block. A plain dict is an entry of one block (snapshots restore those; an
    entry whose blocks part ways inside a chunk is split into them, one cut
    at a chunk boundary into two runs, ``blockindex``). Like an op, it holds
    its blocks and hashes packed (:class:`PackedBlocks`)."""

    __slots__ = ("packed_ids", "packed_hashes")

    def __init__(self, ops: dict[int, Op], packed_ids: bytes, packed_hashes: bytes) -> None:
        super().__init__(ops)
        self.packed_ids = packed_ids
        self.packed_hashes = packed_hashes

    def cut(self, blocks: int) -> None:
        """Keep only the first ``blocks`` blocks and their hashes."""
        end = blocks * PACKED_INT_BYTES
        self.packed_ids, self.packed_hashes = self.packed_ids[:end], self.packed_hashes[:end]


def holders(entry: Op | dict[int, Op] | None) -> tuple[Op, ...]:
    """The ops of one ``State.owners`` entry."""
    if entry is None:
        return ()
    if isinstance(entry, Op):
        return (entry,)
    return tuple(entry.values())


@attrs.define(slots=True, eq=False)
class StepContext:
    """Per-step drain budget, alive from a ``StepScheduled`` until its answers
    are all in (the pin cascade can select more after ``FreeQueueRead``)."""

    ops_left: int
    pin_headroom_blocks: int
    depth_blocks: int
    window_seen: set[int]
    window_pinned_blocks: int = 0
    read_depth_blocks: int = 0  # what the outstanding ``ReadFreeQueue`` asked for


@attrs.define(slots=True, eq=False)
class State:
    config: OffloadConfig
    world_size: int
    closed: str | None = None  # why the machine closed: a failed step, or shutdown
    step_index: int = 0  # token-producing steps seen
    last_step_tokens: int = 0
    selected_in_step: int = 0
    time_s: float = 0.0
    ema_blocks: float | None = None
    peak_blocks: float = 0.0  # decaying peak of per-step allocation (the shield's reach)
    depth_blocks: int = 0
    next_step_blocks: int = 0
    reserve_blocks: int = 0  # blocks the next step's running requests may need
    pin_steps_ema: float = 1.0  # token steps from selection to release (a pin's lifetime)
    free_blocks: int = 0
    requests: dict[str, RequestState] = attrs.Factory(dict)
    pending: dict[str, RequestState] = attrs.Factory(dict)  # has buffered ops, in entry order
    ready: dict[str, None] = attrs.Factory(dict)  # FIFO: finished, buffered, not blocked
    shielded: dict[str, None] = attrs.Factory(dict)  # has protected buffered ops
    # EA: block id -> the buffered op(s) covering it (one op, or a dict by op id when
    # shared). All holders of a block share its snapshot hash (see blockindex.index).
    owners: dict[int, Op | dict[int, Op]] = attrs.Factory(dict)
    # EA: block id -> the snapshot hash its holders share (derived from ``owners``
    # for O(1) reallocation checks).
    owner_hashes: dict[int, BlockHash] = attrs.Factory(dict)
    # EA content dedup: last-block hash of chunks stored (bounded, oldest first out)
    # and of chunks selected or in flight (counted).
    stored_keys: dict[int, None] = attrs.Factory(dict)
    stored_keys_xor: int = 0  # running fingerprint of stored_keys, for the digest
    # Derived from stored_keys: the keys in the order remembered, with one stale
    # entry per key forgotten since (counted in stored_stale), so the oldest is found
    # from the left in O(1) amortised (``next(iter(stored_keys))`` costs O(keys
    # deleted from the dict's front) in CPython: a scan per store at the bound).
    stored_order: deque[int] = attrs.Factory(deque)
    stored_stale: dict[int, int] = attrs.Factory(dict)
    claimed_keys: dict[int, int] = attrs.Factory(dict)
    deadlines: list[tuple[float, int, str, int]] = attrs.Factory(list)  # heap
    batches: dict[int, Batch] = attrs.Factory(dict)
    pins: dict[int, int] = attrs.Factory(dict)  # block id -> protections we hold
    awaiting_hashes: dict[int, None] = attrs.Factory(dict)
    awaiting_queue: bool = False
    context: StepContext | None = None
    next_op_id: int = 0
    next_batch_id: int = 0
    next_order: int = 0
    # The tail flush (``tail_flush``): consecutive empty steps, ops it selected this
    # step, and the end of the shutdown wait (None until vLLM began shutting down).
    idle_steps: int = 0
    flushed_in_step: int = 0
    shutdown_until_s: float | None = None
    counters: dict[Counter, int] = attrs.Factory(new_counters)
    # Derived from the ops' statuses: how many ops, and tokens, are buffered,
    # verifying and in flight now (``legality.move`` keeps them; the gauges
    # read them in O(1) instead of a pass over the backlog).
    live_ops: dict[OpStatus, int] = attrs.Factory(lambda: dict.fromkeys(LIVE, 0))
    live_tokens: dict[OpStatus, int] = attrs.Factory(lambda: dict.fromkeys(LIVE, 0))


# Indexes kept beside the fields they mirror, for speed: snapshots leave them out
# and :func:`rederive` makes them again on restore.
DERIVED: Final = frozenset({"owner_hashes", "stored_order", "stored_stale",
                            "live_ops", "live_tokens"})


def owner_hashes_of(owners: dict[int, Op | dict[int, Op]]) -> dict[int, BlockHash]:
    """``State.owner_hashes`` as ``owners`` implies it."""
    hashes: dict[int, BlockHash] = {}
    by_op: dict[int, dict[int, BlockHash]] = {}  # each op's blocks' first hashes, unpacked once
    for block_id, entry in owners.items():
        first = entry if isinstance(entry, Op) else next(iter(entry.values()))
        of_op = by_op.get(first.op_id)
        if of_op is None:
            of_op = by_op[first.op_id] = {}
            for block, block_hash in zip(first.block_ids, first.block_hashes, strict=True):
                of_op.setdefault(block, block_hash)
        hashes[block_id] = of_op[block_id]
    return hashes


def live_of(state: State) -> tuple[dict[OpStatus, int], dict[OpStatus, int]]:
    """``State.live_ops`` and ``live_tokens`` as the buffers and batches imply them."""
    ops, tokens = dict.fromkeys(LIVE, 0), dict.fromkeys(LIVE, 0)
    for container in (*(rec.ops for rec in state.requests.values()),
                      *(batch.ops for batch in state.batches.values())):
        for op in container:
            if op.status in ops:
                ops[op.status] += 1
                tokens[op.status] += op.tokens
    return ops, tokens


def rederive(state: State) -> None:
    """Set the :data:`DERIVED` fields from the fields they mirror."""
    state.owner_hashes = owner_hashes_of(state.owners)
    state.stored_order = deque(state.stored_keys)
    state.stored_stale = {}
    state.live_ops, state.live_tokens = live_of(state)


def new_state(config: OffloadConfig, *, world_size: int) -> State:
    """A fresh machine for ``world_size`` workers (every rank sends a receipt)."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size!r} is invalid: expected an integer >= 1")
    return State(config=config, world_size=world_size)
