"""The scheduler-side shell: LMCache's lazy-offload manager interface,
implemented by feeding ``offload_fsm`` and executing its commands.

LMCache 0.5.6's ``LMCacheMPConnector`` routes every lazy-offload call through
one object (``_lazy_offload_manager``) with nine methods; this class is that
object. Each call becomes one observation event; :func:`offload_fsm.drive`
applies it and runs the command loop against vLLM's ``BlockPool``:

==========================  ===============================================
core command                what the shell does
==========================  ===============================================
``ProtectBlocks``           ``BlockPool.touch``
``ReadHashes``              read ``block.block_hash`` -> ``HashesRead``
``ReadFreeQueue``           walk the free queue head -> ``FreeQueueRead``
``SubmitStore``             one coalesced STORE in this step's metadata
``ReleaseBlocks``           ``BlockPool.free_blocks``
``EndSession``              returned in ``sessions_to_end``
==========================  ===============================================

No business rule lives here: the shell keeps only what the core cannot (the
LMCache metadata needed to build a store: the request's token list, salt,
configs, and each op's per-group block ids) and logs the decisions.

Everything runs on the vLLM scheduler thread. If the core rejects an event
(a shell bug or a vLLM behaviour we did not model), the shell logs one error
with the sequence number, releases every block the core had protected, and
stops offloading for the rest of the run: it never stores stale KV and never
leaks pins, and vLLM keeps serving.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from lmcache.integration.vllm.lazy_offload_manager import LazyOffloadActions
from lmcache.integration.vllm.lmcache_mp_metadata import LMCacheMPRequestMetadata
from lmcache.integration.vllm.vllm_multi_process_adapter import LoadStoreOp

from connector import blocks
from connector.logs import get_logger
from offload_fsm import OffloadConfig, Policy, drive, new_state
from offload_fsm.commands import (
    Command,
    EndSession,
    ProtectBlocks,
    ReadFreeQueue,
    ReadHashes,
    ReleaseBlocks,
    SubmitStore,
)
from offload_fsm.counters import Counter
from offload_fsm.errors import CommandFailed, StepFailed
from offload_fsm.decisions import (
    DropCause,
    OpRejected,
    OpsDropped,
    ReceiptIgnored,
    RejectReason,
    StoreSettled,
)
from offload_fsm.events import (
    CandidateOffered,
    Event,
    FreeQueueRead,
    HashesRead,
    PrefixCacheReset,
    ReceiptsArrived,
    RequestArrived,
    RequestFinished,
    RequestPreempted,
    ShutdownRequested,
    StepScheduled,
)
from offload_fsm.invariants import ledger_terms
from offload_fsm.machine import Outcome, has_in_flight, window_depth

COUNTERS_LOG_INTERVAL_S = 5.0
MAX_IDS_IN_LOG_LINE = 8


class EventSourcedManager:
    """Drop-in for LMCache's ``LazyOffloadManager`` (same nine methods)."""

    def __init__(
        self,
        config: OffloadConfig,
        *,
        world_size: int,
        group_tokens_per_block: list[int],
        step_budget_tokens: int = 0,
        chunk_tokens: int = 0,
        recorder: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.state = new_state(config, world_size=world_size)
        self._group_tokens_per_block = [t for t in group_tokens_per_block if t > 0]
        self._all_group_tokens_per_block = list(group_tokens_per_block)
        # Chunk-level dedup needs one block stride; with several KV groups the
        # flat block list has none, so ops are then deduplicated whole.
        single = len(group_tokens_per_block) == 1 and chunk_tokens > 0
        self._blocks_per_chunk = chunk_tokens // group_tokens_per_block[0] if single else 0
        # The most blocks one schedule() can hand out for its token budget.
        self._step_budget_blocks = self._blocks_for(step_budget_tokens)
        self._recorder = recorder
        self._clock = clock
        self._pool: Any = None
        self._stopped = False
        self._seq = 0
        # What the core cannot hold: how to build each request's store.
        self._latest: dict[str, LMCacheMPRequestMetadata] = {}
        self._op_blocks: dict[str, dict[int, tuple[int, list[list[int]]]]] = {}
        self._actions = LazyOffloadActions()
        self._evicted_ops = 0
        self._evicted_ids: list[str] = []
        self._last_counters: tuple[int, ...] = ()
        self._last_counters_log_s = 0.0
        self._log = get_logger()

    # -- the LMCache manager interface -----------------------------------

    def bind_block_pool(self, gpu_block_pool: Any) -> None:
        if self._pool is not None and self._pool is not gpu_block_pool:
            raise ValueError("lazy offload is already bound to a different GPU block pool")
        self._pool = gpu_block_pool
        if self.config.policy is Policy.FIFO:
            self._log.info(
                f"lazy offload enabled with FIFO policy, offload threshold: {self.config.threshold}"
            )
        else:
            self._log.info(
                f"lazy offload enabled with EVICTION_AWARE policy: {self.config.describe()}"
            )

    def add_store_candidate(self, metadata: LMCacheMPRequestMetadata) -> None:
        if self._pool is None:
            raise ValueError("lazy offload GPU block pool is not bound")
        op = metadata.op
        req_id = metadata.request_id
        self._latest[req_id] = metadata
        self._op_blocks.setdefault(req_id, {})[op.start] = (op.end, op.block_ids)
        block_ids = tuple(op.flat_block_ids)
        self._feed(
            CandidateOffered(
                req_id=req_id,
                start_token=op.start,
                end_token=op.end,
                block_ids=block_ids,
                block_hashes=blocks.hashes_of(self._pool, block_ids),
                time_s=self._clock(),
                blocks_per_chunk=self._blocks_per_chunk,
            )
        )

    def on_scheduler_step(self, scheduler_output: Any) -> LazyOffloadActions:
        tokens = int(scheduler_output.total_num_scheduled_tokens)
        allocated = _allocated_block_ids(scheduler_output)
        next_step_blocks = self._blocks_for(tokens)
        if self._stopped or self._pool is None:
            return LazyOffloadActions()
        pool = self._pool
        free = blocks.free_count(pool)
        depth = window_depth(self.state, scheduled_tokens=tokens,
                             allocated_blocks=len(allocated), next_step_blocks=next_step_blocks)
        reallocated: tuple[tuple[int, int | None], ...] = ()
        if tokens:
            owners = self.state.owners  # read-only: the core's watch set
            watched = [b for b in allocated if b in owners]
            reallocated = tuple(zip(watched, blocks.hashes_of(pool, watched), strict=True))
        self._feed(
            StepScheduled(
                scheduled_tokens=tokens,
                allocated_blocks=len(allocated),
                next_step_blocks=next_step_blocks,
                reserve_blocks=self._reserve_blocks(scheduler_output),
                free_blocks=free,
                window_block_ids=blocks.free_queue_head(pool, min(depth, free)),
                reallocated=reallocated,
                time_s=self._clock(),
            )
        )
        self._flush_evicted_log()
        self._maybe_log_counters()
        return self._take_actions()

    def on_store_results(
        self, failed_request_ids: set[str], completed_store_counts: dict[str, int]
    ) -> LazyOffloadActions:
        self._feed(
            ReceiptsArrived(
                completed=tuple(sorted(completed_store_counts.items())),
                failed=tuple(sorted(failed_request_ids)),
            )
        )
        return self._take_actions()

    def on_request_finished(self, request_id: str) -> LazyOffloadActions:
        free = blocks.free_count(self._pool) if self._pool is not None else 0
        self._feed(RequestFinished(req_id=request_id, free_blocks=free,
                                   next_step_max_blocks=self._step_budget_blocks))
        return self._take_actions()

    def on_request_reset(self, request_id: str) -> None:
        self._feed(RequestPreempted(req_id=request_id))

    def on_request_arrived(self, request_id: str) -> LazyOffloadActions:
        reused = request_id in self.state.requests
        self._feed(RequestArrived(req_id=request_id))
        actions = self._take_actions()
        if reused and request_id in actions.sessions_to_end:
            self._log.info(
                f"Lazy offload: request id {request_id} reused while its predecessor's "
                "teardown was deferred; released the predecessor's session"
            )
        return actions

    def has_inflight_store_work(self) -> bool:
        return not self._stopped and has_in_flight(self.state)

    def log_final_stats(self) -> None:
        if not self._stopped:
            self._feed(ShutdownRequested())
            self._stopped = True
        self._log.info(f"Lazy offload final counters: {self.counters_line()}")
        if self._recorder is not None:
            self._recorder.close(self.state)

    def reset_prefix_cache(self) -> None:
        """vLLM reset its prefix cache (every block hash is gone)."""
        self._feed(PrefixCacheReset())

    def _reserve_blocks(self, scheduler_output: Any) -> int:
        """Blocks this step's running requests are expected to need next step:
        a decode whose next token starts a new block, and a prefilling request
        continuing with a chunk like this one."""
        block = self._group_tokens_per_block[0] if self._group_tokens_per_block else 1
        scheduled = scheduler_output.num_scheduled_tokens
        need = 0
        for request in scheduler_output.scheduled_new_reqs:
            need += -(-scheduled[request.req_id] // block)  # prefilling: another chunk
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, done in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            tokens = scheduled[req_id]
            if tokens > 1:
                need += -(-tokens // block)
            elif (done + tokens) % block == 0:
                need += 1  # a decode whose next token opens a new block
        return need * max(1, len(self._group_tokens_per_block))

    def _blocks_for(self, tokens: int) -> int:
        return sum(math.ceil(tokens / t) for t in self._group_tokens_per_block)

    # -- ledger -----------------------------------------------------------

    def counters_line(self) -> str:
        counters = self.state.counters
        body = " ".join(f"{name}={value}" for name, value in counters.items() if value)
        terms = ledger_terms(self.state)
        closes = counters[Counter.ADMITTED_OPS] == sum(terms.values())
        return f"{body} pending={terms['pending']} ledger_closes={closes}"

    # -- the command loop -------------------------------------------------

    def _feed(self, event: Event) -> None:
        if self._stopped:
            return
        try:
            applied = drive(self.state, event, self._execute)
        except StepFailed as error:
            self._applied(list(error.applied))
            if self._recorder is not None:
                self._recorder.record_rejected(error.applied, error.event, error.reason, self.state)
            self._stop(error)
            return
        except CommandFailed as error:
            self._applied(list(error.applied))
            self._stop(error)
            return
        self._applied(applied)

    def _applied(self, applied: list[tuple[Event, Outcome]]) -> None:
        for _, outcome in applied:
            self._note(outcome)
        self._seq += len(applied)
        if self._recorder is not None and applied:
            self._recorder.record(applied, self.state)

    def _execute(self, command: Command) -> Event | None:
        pool = self._pool
        if isinstance(command, ProtectBlocks):
            blocks.touch(pool, command.block_ids)
        elif isinstance(command, ReadHashes):
            return HashesRead(batch_id=command.batch_id,
                              block_hashes=blocks.hashes_of(pool, command.block_ids))
        elif isinstance(command, ReadFreeQueue):
            depth = min(command.depth_blocks, blocks.free_count(pool))
            return FreeQueueRead(window_block_ids=blocks.free_queue_head(pool, depth))
        elif isinstance(command, SubmitStore):
            self._actions.stores_to_submit.append(self._store_metadata(command))
        elif isinstance(command, ReleaseBlocks):
            blocks.release(pool, command.block_ids)
        elif isinstance(command, EndSession):
            self._actions.sessions_to_end.append(command.req_id)
            self._latest.pop(command.req_id, None)
            self._op_blocks.pop(command.req_id, None)
        return None

    def _store_metadata(self, command: SubmitStore) -> LMCacheMPRequestMetadata:
        latest = self._latest[command.req_id]
        ops = self._op_blocks[command.req_id]
        # The core may have trimmed already-stored chunks off the first op.
        start = max(s for s in ops if s <= command.start_token)
        end, first_groups = ops.pop(start)
        cut = command.start_token - start
        merged = [
            list(group[cut // tpb:]) if tpb > 0 else list(group)
            for group, tpb in zip(first_groups, self._all_group_tokens_per_block, strict=True)
        ]
        while end < command.end_token:
            end, group_block_ids = ops.pop(end)
            for into, group in zip(merged, group_block_ids, strict=True):
                into.extend(group)
        return LMCacheMPRequestMetadata(
            request_id=command.req_id,
            direction="STORE",
            op=LoadStoreOp(
                token_ids=latest.op.token_ids,
                block_ids=merged,
                start=command.start_token,
                end=command.end_token,
            ),
            cache_salt=latest.cache_salt,
            request_configs=latest.request_configs,
        )

    def _take_actions(self) -> LazyOffloadActions:
        actions, self._actions = self._actions, LazyOffloadActions()
        return actions

    def _stop(self, error: StepFailed | CommandFailed) -> None:
        self._stopped = True
        held = [b for b, n in self.state.pins.items() for _ in range(n)]
        if held and self._pool is not None:
            blocks.release(self._pool, held)
        self._log.error(
            "lazy offload stopped: the core rejected an event; offloading is off for "
            "the rest of this run and every protected block was released",
            seq=self._seq,
            error=str(error),
            released_blocks=len(held),
        )

    # -- logging (quiet: one line per loss site, ledger every few seconds) --

    def _note(self, outcome: Outcome) -> None:
        for decision in outcome.decisions:
            if isinstance(decision, OpsDropped):
                if decision.ops:  # ops == 0: chunks trimmed off an op that goes on
                    self._forget(decision.req_id, decision.start_token, decision.end_token)
                self._log_drop(decision)
            elif isinstance(decision, OpRejected):
                self._forget(decision.req_id, decision.start_token, decision.end_token)
                if decision.reason is RejectReason.UNHASHED:
                    self._log.warning(
                        f"Lazy offload: skipping store for request {decision.req_id} tokens "
                        f"[{decision.start_token}, {decision.end_token}) and every later "
                        "operation of it: covered blocks carry no prefix-cache hash"
                    )
            elif isinstance(decision, StoreSettled) and decision.failed and not decision.orphaned:
                self._log.warning(f"Store failed for request {decision.req_id}",
                                  batch_id=decision.batch_id, ops=decision.ops)
            elif isinstance(decision, ReceiptIgnored):
                self._log.warning(
                    f"Ignoring store-completion receipt for request {decision.req_id} "
                    "with no in-flight store batch",
                    reason=decision.reason.value,
                )

    def _log_drop(self, decision: OpsDropped) -> None:
        cause = decision.cause
        if cause is DropCause.STALE and decision.block_id >= 0:
            self._log.warning(
                f"Block hashes missing or mismatched for request {decision.req_id}, "
                "dropping its remaining store operations",
                block_id=decision.block_id,
            )
        elif cause is DropCause.EVICTED:
            self._evicted_ops += decision.ops
            if len(self._evicted_ids) < MAX_IDS_IN_LOG_LINE:
                self._evicted_ids.append(decision.req_id)
        elif cause is DropCause.PREEMPTED:
            self._log.info(
                f"Lazy offload: dropped {decision.ops} buffered store op(s) of preempted "
                f"request {decision.req_id}"
            )
        elif cause is DropCause.STORE_FAILED:
            self._log.warning(
                f"Store failed for request {decision.req_id}; dropped {decision.ops} "
                "held-back store op(s) that would lack their stored prefix"
            )

    def _flush_evicted_log(self) -> None:
        if self._evicted_ops:
            self._log.info(
                f"Lazy offload: dropped {self._evicted_ops} store op(s), blocks evicted "
                f"before drain ({', '.join(self._evicted_ids)})"
            )
            self._evicted_ops = 0
            self._evicted_ids = []

    def _maybe_log_counters(self) -> None:
        now = self._clock()
        if now - self._last_counters_log_s < COUNTERS_LOG_INTERVAL_S:
            return
        snapshot = tuple(self.state.counters.values())
        if snapshot != self._last_counters:
            self._last_counters = snapshot
            self._last_counters_log_s = now
            self._log.info(f"Lazy offload counters: {self.counters_line()}")

    def _forget(self, req_id: str, start: int, end: int) -> None:
        ops = self._op_blocks.get(req_id)
        if not ops:
            return
        for op_start in [s for s in ops if start <= s < end]:
            del ops[op_start]


def _allocated_block_ids(scheduler_output: Any) -> list[int]:
    """Every block id handed to a request this step (all groups): new
    requests' whole tables and cached requests' new blocks."""
    out: list[int] = []
    for request in scheduler_output.scheduled_new_reqs:
        for group in request.block_ids:
            out.extend(group)
    for groups in scheduler_output.scheduled_cached_reqs.new_block_ids:
        if groups:
            for group in groups:
                out.extend(group)
    return out
