"""Input events: facts the connector observed, in the order it observed them.

Every event is a frozen, keyword-only attrs class with a class-level wire tag
``TAG`` that is never renumbered (append new tags; see ``log.wire``). Block
hashes are 64-bit fingerprints of vLLM's block hash (``None`` when the block
carries no prefix-cache hash); times are logical inputs in seconds that the
connector stamps, never read by the core.

Two kinds of event:

* **Observations** come from vLLM callbacks: :class:`RequestArrived`,
  :class:`CandidateOffered`, :class:`StepScheduled`, :class:`RequestFinished`,
  :class:`RequestPreempted`, :class:`ReceiptsArrived`,
  :class:`PrefixCacheReset`, :class:`ShutdownRequested`,
  :class:`ChunksMissing`, :class:`ShutdownBegan`, :class:`StepsPassed`,
  :class:`LookupAnswered`.
* **Answers** report the result of a command the core asked for:
  :class:`HashesRead` answers ``ReadHashes`` and :class:`FreeQueueRead`
  answers ``ReadFreeQueue``. While answers are outstanding the core accepts no
  observation (the shell runs the command loop to completion inside one
  callback; see ``machine.drive``).
"""

from __future__ import annotations

from typing import ClassVar, Final

import attrs

BlockHash = int | None


@attrs.frozen(kw_only=True)
class RequestArrived:
    """The connector saw a request id for the first time (tracker created), or
    again after a preemption. Source: ``get_num_new_matched_tokens``."""

    TAG: ClassVar[int] = 1
    req_id: str


@attrs.frozen(kw_only=True)
class CandidateOffered:
    """A chunk-aligned store candidate ``[start_token, end_token)`` of a request
    is ready, with its block ids and the block-hash snapshot read now.
    ``blocks_per_chunk`` says how many blocks make one LMCache chunk (0: treat
    the whole range as one unit). Source: ``build_connector_meta`` (the request
    tracker's store metadata)."""

    TAG: ClassVar[int] = 2
    req_id: str
    start_token: int
    end_token: int
    block_ids: tuple[int, ...]
    block_hashes: tuple[BlockHash, ...]
    time_s: float
    blocks_per_chunk: int = 0


@attrs.frozen(kw_only=True)
class StepScheduled:
    """A scheduler step was built. Source: ``build_connector_meta``.

    Fields:
      scheduled_tokens: total tokens scheduled this step (0 = empty step).
      allocated_blocks: gross count of block ids newly handed out this step.
      next_step_blocks: feed-forward estimate of next step's allocation.
      reserve_blocks: the shell's estimate of the blocks this step's running
        requests need next step (decodes crossing a block boundary, and
        continuing prefill chunks up to each prompt's end): the reserve the
        pin budget keeps free.
      free_blocks: length of vLLM's free queue after this step's allocation.
      window_block_ids: the first ``window_depth(...)`` block ids of the free
        queue from the eviction head (rank 0 first), as the connector read them.
      reallocated: ``(block_id, hash_now)`` for every block this step allocated
        that the core watches (``queries.watches``) whose hash is no longer the
        one its buffered ops snapshotted (``queries.changed_hashes``): how
        reuse is seen incrementally, without re-hashing the backlog. A
        prefix-cache hit on a watched block keeps its hash and is left out
        (logs written before carried those too; to the core they are no-ops).
      time_s: logical time, for ``max_deferral_seconds``.
    """

    TAG: ClassVar[int] = 3
    scheduled_tokens: int
    allocated_blocks: int
    next_step_blocks: int
    reserve_blocks: int
    free_blocks: int
    window_block_ids: tuple[int, ...]
    reallocated: tuple[tuple[int, BlockHash], ...]
    time_s: float


@attrs.frozen(kw_only=True)
class RequestFinished:
    """vLLM finished (or aborted) a request; its blocks are about to be freed.
    ``free_blocks`` is the free-queue length before they are;
    ``next_step_max_blocks`` the most blocks the next ``schedule()`` can take
    (its token budget in blocks). Source: ``request_finished``."""

    TAG: ClassVar[int] = 4
    req_id: str
    free_blocks: int
    next_step_max_blocks: int = 0


@attrs.frozen(kw_only=True)
class RequestPreempted:
    """vLLM preempted a request and freed its blocks; it restarts from token 0.
    Source: ``get_num_new_matched_tokens`` on a PREEMPTED request."""

    TAG: ClassVar[int] = 5
    req_id: str


@attrs.frozen(kw_only=True)
class ReceiptsArrived:
    """Store receipts aggregated over workers for one engine step: per request
    id, how many workers completed its in-flight store, and which failed.
    Source: ``update_connector_output``."""

    TAG: ClassVar[int] = 6
    completed: tuple[tuple[str, int], ...]
    failed: tuple[str, ...]


@attrs.frozen(kw_only=True)
class HashesRead:
    """Answer to ``ReadHashes``: the current hashes of the batch's blocks, read
    after they were protected, in the command's order."""

    TAG: ClassVar[int] = 7
    batch_id: int
    block_hashes: tuple[BlockHash, ...]


@attrs.frozen(kw_only=True)
class FreeQueueRead:
    """Answer to ``ReadFreeQueue``: the first ``depth_blocks`` free-queue block
    ids, read after this step's protections (the pin cascade)."""

    TAG: ClassVar[int] = 8
    window_block_ids: tuple[int, ...]


@attrs.frozen(kw_only=True)
class PrefixCacheReset:
    """vLLM reset its prefix cache: every block hash is gone. Source: the
    block pool's ``reset_prefix_cache`` when it succeeds (the shell wraps it:
    vLLM tells no connector of ``LLM.reset_prefix_cache()``)."""

    TAG: ClassVar[int] = 9


@attrs.frozen(kw_only=True)
class ShutdownRequested:
    """The connector is shutting down. Source: ``shutdown``."""

    TAG: ClassVar[int] = 10


@attrs.frozen(kw_only=True)
class ChunksMissing:
    """A lookup showed that LMCache does not hold these chunks, although the
    core remembers them stored: its L1 is finite (LRU), so the server forgets.
    ``chunk_keys`` are the chunks' content keys (``Op.chunk_keys``: the
    fingerprint of each chunk's last block hash). Source: the scheduler-side
    lookup result (``get_num_new_matched_tokens``): the chunks of the
    request's prefix beyond the server's hit that the core believes stored.

    Keyed by content, not by request: the core's memory of what is stored
    (``State.stored_keys``) is keyed by content and shared by every request,
    and the request that looked up may be unknown to the core (a lookup runs
    before its arrival) or may never have offered these chunks itself (its
    candidates were rejected as already stored)."""

    TAG: ClassVar[int] = 11
    chunk_keys: tuple[int, ...]


@attrs.frozen(kw_only=True)
class ShutdownBegan:
    """vLLM began shutting down (its engine process got SIGTERM or SIGINT)
    and keeps stepping while the connector reports pending work; fed once,
    just before the next ``StepScheduled``, only where the shutdown flush is
    on (``shutdown_flush_s``). ``time_s``: when the signal came (logical
    time, as on ``StepScheduled``). Source: the connector's signal hook,
    read in ``build_connector_meta``."""

    TAG: ClassVar[int] = 12
    time_s: float


PassedStep = tuple[int, int, int, int, int, int, float]
"""One passed token step: ``(scheduled_tokens, allocated_blocks,
next_step_blocks, reserve_blocks, free_blocks, window_blocks, time_s)``, the
fields of its ``StepScheduled`` with the window's length for its ids."""


@attrs.frozen(kw_only=True)
class StepsPassed:
    """Token steps that moved nothing the core watches, reported together,
    in order, before the shell's next other event. Source:
    ``build_connector_meta`` under EVICTION_AWARE, for each step the shell
    found quiet (``queries.step_passes``): no buffered block in its window,
    no watched block reallocated, nothing shielded, overdue or in flight
    under a lease. The core folds each as it would the ``StepScheduled``
    (allocation EMA, peak, danger depth, counters, time) and checks what the
    log can check: the window's length, no shield, no overdue op.

    Fields:
      steps: one :data:`PassedStep` per token step, oldest first; at most
        ``MAX_STEPS_PASSED``.
    """

    TAG: ClassVar[int] = 13
    steps: tuple[PassedStep, ...]


MAX_STEPS_PASSED: Final[int] = 64
"""The most token steps one ``StepsPassed`` carries (the shell's run of
quiet steps is reported when it reaches this, so the core's step count lags
the engine's by fewer steps)."""


@attrs.frozen(kw_only=True)
class LookupAnswered:
    """LMCache answered a waiting request's lookup, and vLLM's ``schedule()``
    may now allocate for it, from the free queue's head, before any drain
    runs: the request's LMCache hit (up to its whole prompt, taken at once)
    and its new tokens (up to the step's token budget). Fed only under
    EVICTION_AWARE, and only when that allocation could reach a buffered
    block (``window_block_ids`` holds one). Source:
    ``get_num_new_matched_tokens``, after LMCache's answer, which vLLM
    follows with ``allocate_slots`` for the request in the same
    ``schedule()``.

    Fields:
      req_id: the request that looked up (ACTIVE in the core).
      allocation_blocks: the most blocks that allocation can take from the
        free queue: ``cdiv(min(prompt tokens, local hit + LMCache hit +
        token budget), block size)`` less the local hit's blocks.
      free_blocks: the free queue's length now.
      window_block_ids: the free queue's head (rank 0 first), read until
        ``allocation_blocks`` blocks that no buffered op covers were seen, or
        to the queue's end: a buffered block the core protects leaves the
        queue and the allocation takes the next block instead, so these are
        every block the allocation can reach, and its reach is exact.
    """

    TAG: ClassVar[int] = 14
    req_id: str
    allocation_blocks: int
    free_blocks: int
    window_block_ids: tuple[int, ...]


Event = (
    RequestArrived
    | CandidateOffered
    | StepScheduled
    | RequestFinished
    | RequestPreempted
    | ReceiptsArrived
    | HashesRead
    | FreeQueueRead
    | PrefixCacheReset
    | ShutdownRequested
    | ChunksMissing
    | ShutdownBegan
    | StepsPassed
    | LookupAnswered
)

EVENT_TYPES: tuple[type[Event], ...] = (
    RequestArrived,
    CandidateOffered,
    StepScheduled,
    RequestFinished,
    RequestPreempted,
    ReceiptsArrived,
    HashesRead,
    FreeQueueRead,
    PrefixCacheReset,
    ShutdownRequested,
    ChunksMissing,
    ShutdownBegan,
    StepsPassed,
    LookupAnswered,
)
# Answers report a command's result; every other event is an observation.
ANSWER_TYPES: tuple[type[Event], ...] = (HashesRead, FreeQueueRead)
OBSERVATION_TYPES: tuple[type[Event], ...] = tuple(
    cls for cls in EVENT_TYPES if cls not in ANSWER_TYPES
)
