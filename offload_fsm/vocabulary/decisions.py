"""Decisions: what the machine chose, as data the event log and replay explain.

Every decision is a frozen, keyword-only attrs class with a never-renumbered
wire tag (decision tags start at 100). Token ranges are ``[start_token,
end_token)``; ``ops`` counts store operations (chunk-aligned candidates).
Causes and reasons are enums whose string values are wire-stable.
"""

from __future__ import annotations

import enum
from typing import ClassVar

import attrs


class RejectReason(enum.Enum):
    """Why a candidate never entered the buffer (outside the ledger's ``admitted``)."""

    UNHASHED = "unhashed"  # a covered block has no prefix-cache hash
    PREFIX_BROKEN = "prefix_broken"  # an earlier range of the request was lost
    ALREADY_STORED = "already_stored"  # the same content was stored for another request


class SelectReason(enum.Enum):
    """Why a request's front ops were selected for a store."""

    WINDOW = "window"  # a block sits inside the danger window (EVICTION_AWARE)
    CASCADE = "cascade"  # moved into the window by this step's own pins
    SHIELDED = "shielded"  # protected at finish to close the blind window
    OVERDUE = "overdue"  # max_deferral_seconds passed
    FIFO = "fifo"  # ready count reached the threshold (FIFO)
    IDLE_FLUSH = "idle_flush"  # idle_flush_steps empty steps in a row (the tail flush)
    SHUTDOWN_FLUSH = "shutdown_flush"  # vLLM began shutting down (shutdown_flush_s)

    # Keys hot tables: Enum's __hash__ runs in Python; members are singletons,
    # so the C identity hash is equivalent (and much faster).
    __hash__ = object.__hash__


class DropCause(enum.Enum):
    """Why buffered ops left the buffer without being stored. Each is a ledger term."""

    EVICTED = "evicted"  # a block was reallocated before the drain
    PREEMPTED = "preempted"
    ID_REUSE = "id_reuse"
    STORE_FAILED = "store_failed"  # held back behind a failed store
    STALE = "stale"  # hash mismatch or missing at verification (skipped)
    CACHE_RESET = "cache_reset"
    SHUTDOWN = "shutdown"
    DUPLICATE = "duplicate"  # not a loss: another request's batch holds the same content

    # Keys hot tables: Enum's __hash__ runs in Python; members are singletons,
    # so the C identity hash is equivalent (and much faster).
    __hash__ = object.__hash__


class HoldReason(enum.Enum):
    """Why a due request was not selected this step (it stays buffered)."""

    DRAIN_CAP = "drain_cap"  # max_drain_per_step ops already selected
    PIN_BUDGET = "pin_budget"  # pinning would eat the next step's free blocks
    IN_FLIGHT = "in_flight"  # its previous store batch has not completed
    CLAIMED = "claimed"  # its chunks are all in another request's batch in flight (dedup)

    # Keys hot tables: Enum's __hash__ runs in Python; members are singletons,
    # so the C identity hash is equivalent (and much faster).
    __hash__ = object.__hash__


class SplitReason(enum.Enum):
    """Why a buffered op was cut at a chunk boundary (``split``)."""

    PIN_BUDGET = "pin_budget"  # its queued blocks exceed the plan's pin headroom
    SHIELD = "shield"  # a shield (at finish, at a lookup) of all of it would take the reserve


class IgnoreReason(enum.Enum):
    UNKNOWN_REQUEST = "unknown_request"  # no in-flight batch for that id
    EXCESS_COUNT = "excess_count"  # more receipts than workers
    LEASE_EXPIRED = "lease_expired"  # a late report of a batch abandoned at its lease


@attrs.frozen(kw_only=True)
class OpRejected:
    TAG: ClassVar[int] = 100
    req_id: str
    start_token: int
    end_token: int
    reason: RejectReason


@attrs.frozen(kw_only=True)
class OpsSelected:
    """Front ops of a request were taken from the buffer into a verifying batch."""

    TAG: ClassVar[int] = 101
    req_id: str
    batch_id: int
    start_token: int
    end_token: int
    ops: int
    reason: SelectReason
    rank: int  # lowest free-queue rank among its blocks, -1 if none


@attrs.frozen(kw_only=True)
class OpsDropped:
    """Buffered (or verifying) ops were dropped; ``block_id`` names the block
    whose reuse caused it, when one did (-1 otherwise)."""

    TAG: ClassVar[int] = 102
    req_id: str
    start_token: int
    end_token: int
    ops: int
    tokens: int
    cause: DropCause
    block_id: int


@attrs.frozen(kw_only=True)
class StoreSubmitted:
    TAG: ClassVar[int] = 103
    req_id: str
    batch_id: int
    start_token: int
    end_token: int
    ops: int
    blocks: int


@attrs.frozen(kw_only=True)
class StoreSettled:
    """Every worker reported on a batch; ``failed`` if any of them failed."""

    TAG: ClassVar[int] = 104
    req_id: str
    batch_id: int
    ops: int
    tokens: int
    failed: bool
    orphaned: bool


@attrs.frozen(kw_only=True)
class OpsHeld:
    """A due request stayed buffered this step."""

    TAG: ClassVar[int] = 105
    req_id: str
    ops: int
    reason: HoldReason


@attrs.frozen(kw_only=True)
class ReceiptIgnored:
    TAG: ClassVar[int] = 106
    req_id: str
    count: int
    failed: bool
    reason: IgnoreReason


@attrs.frozen(kw_only=True)
class OpsShielded:
    """Buffered ops were protected before an allocation could reach them:
    at their request's finish, ops whose blocks would land inside the danger
    window once freed (the blind-window rule; ``reach_blocks``: how deep the
    next schedule() can allocate: danger depth, token budget or recent peak,
    the largest), or at another request's lookup (``LookupAnswered``), ops
    with blocks in the reach of its allocation (``reach_blocks``: the
    free-queue blocks that allocation can reach)."""

    TAG: ClassVar[int] = 107
    req_id: str
    ops: int
    blocks: int
    free_blocks: int
    reach_blocks: int


@attrs.frozen(kw_only=True)
class BatchOrphaned:
    """Preemption or id reuse detached an in-flight batch from the request's
    current generation: its receipts still release pins, its failure is not
    charged to the successor."""

    TAG: ClassVar[int] = 108
    req_id: str
    batch_id: int


@attrs.frozen(kw_only=True)
class ShieldLifted:
    """An empty step (the engine went idle) unpinned ops shielded at finish:
    idle never drains, so pins must not outlive the traffic."""

    TAG: ClassVar[int] = 109
    req_id: str
    ops: int
    blocks: int


@attrs.frozen(kw_only=True)
class StoreAbandoned:
    """A submitted batch's receipts did not all arrive within the receipt lease:
    its pins are released, its ops are booked abandoned, and its request's
    chain is broken (LMCache may or may not hold the chunks)."""

    TAG: ClassVar[int] = 110
    req_id: str
    batch_id: int
    ops: int
    tokens: int
    receipts: int  # of the world size that did arrive
    waited_s: float


@attrs.frozen(kw_only=True)
class StoredChunksForgotten:
    """A lookup showed chunks missing on the server that the core remembered
    stored (``ChunksMissing``): they are forgotten, so later candidates for
    them are admitted and stored again instead of rejected as already
    stored. ``chunk_keys``: the forgotten ones, in the reported order;
    ``reported``: how many keys the lookup named (the rest were not
    remembered)."""

    TAG: ClassVar[int] = 111
    chunk_keys: tuple[int, ...]
    reported: int


class FlushTrigger(enum.Enum):
    IDLE = "idle"  # idle_flush_steps consecutive empty steps
    SHUTDOWN = "shutdown"  # vLLM began shutting down


@attrs.frozen(kw_only=True)
class TailFlushed:
    """The tail flush (``tail_flush``) selected the intact buffered ops of every
    finished request without a batch in flight: ``requests`` requests,
    ``ops`` ops, ``tokens`` tokens (each request also has its
    ``OpsSelected``; verification still skips stale ones). ``idle_steps``:
    consecutive empty steps so far."""

    TAG: ClassVar[int] = 113
    trigger: FlushTrigger
    requests: int
    ops: int
    tokens: int
    idle_steps: int


@attrs.frozen(kw_only=True)
class ShutdownFlushBegan:
    """vLLM began shutting down (``ShutdownBegan``): flush the tail and
    wait for receipts until ``until_s`` (logical time)."""

    TAG: ClassVar[int] = 114
    until_s: float


@attrs.frozen(kw_only=True)
class ShutdownLeft:
    """At shutdown, with the shutdown flush on: what never reached LMCache,
    buffered (dropped ``shutdown``) or submitted without all receipts
    (abandoned)."""

    TAG: ClassVar[int] = 115
    requests: int
    buffered_ops: int
    buffered_tokens: int
    in_flight_ops: int
    in_flight_tokens: int


@attrs.frozen(kw_only=True)
class OpSplit:
    """A buffered op ``[start_token, end_token)`` was cut at ``split_token``, a
    chunk boundary: its first ``front_blocks`` blocks fit where the whole op
    did not (the pin headroom or the shield's), so they are protected now;
    ``[split_token, end_token)`` stays buffered as a new op behind them."""

    TAG: ClassVar[int] = 112
    req_id: str
    start_token: int
    split_token: int
    end_token: int
    front_blocks: int
    reason: SplitReason


Decision = (
    OpRejected
    | OpsSelected
    | OpsDropped
    | StoreSubmitted
    | StoreSettled
    | OpsHeld
    | ReceiptIgnored
    | OpsShielded
    | BatchOrphaned
    | ShieldLifted
    | StoreAbandoned
    | StoredChunksForgotten
    | TailFlushed
    | ShutdownFlushBegan
    | ShutdownLeft
    | OpSplit
)

DECISION_TYPES: tuple[type[Decision], ...] = (
    OpRejected,
    OpsSelected,
    OpsDropped,
    StoreSubmitted,
    StoreSettled,
    OpsHeld,
    ReceiptIgnored,
    OpsShielded,
    BatchOrphaned,
    ShieldLifted,
    StoreAbandoned,
    StoredChunksForgotten,
    TailFlushed,
    ShutdownFlushBegan,
    ShutdownLeft,
    OpSplit,
)
