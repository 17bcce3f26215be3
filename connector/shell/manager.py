"""The scheduler-side shell: LMCache's lazy-offload manager interface,
implemented by feeding ``offload_fsm`` and executing its commands.

LMCache 0.5.6's ``LMCacheMPConnector`` routes every lazy-offload call through
one object (``_lazy_offload_manager``) with nine methods; this class is that
object. Each call becomes one observation event, which
``connector.shell.feeding`` applies (:func:`offload_fsm.drive`, the command
loop against vLLM's ``BlockPool`` in ``connector.shell.pool_commands``, which
also keeps the shell's records of what it pinned and submitted) and records.
The step's work is one pass (:meth:`EventSourcedManager._pass`) that runs
while the model does (``connector.shell.beside``): what ``schedule()``
observed (arrivals, offers) and the last step's receipts wait for it; its
stores go out with the next step. A finish whose shield pins is applied at
once, before vLLM frees the blocks; one that pins nothing (most) waits for
the next pass with the rest (``queries.finish_waits``).

No business rule lives here: stores are built by ``connector.shell.stores``, steps read
by ``connector.shell.step_reading``, log lines made by ``connector.shell.narrator``.

Keeping vLLM stepping (:meth:`has_inflight_store_work`): while the core has
work, vLLM's busy loop runs zero-token steps, whose connector metadata the
workers still execute (``kv_connector_no_forward``): stores settle, a tail
flush (``offload_fsm.rules.tail_flush``) or the shutdown flush
(:meth:`shutdown_began`, from ``connector.shell.shutdown_signal``) goes out.

Never take vLLM down: no exception leaves these methods (``hooks.hook``).
On any failure, of the core (a rejected event, a core bug) or of the shell,
the shell logs one error (the event's sequence number, the reason), records
the applied events and the rejection, and switches to drain-only mode
(``offload_fsm.after_failure``): pins of ops LMCache never saw are released at
once, pins of stores it was handed are kept until their receipts arrive (or
their lease ends), sessions keep ending, nothing new is submitted, and vLLM
keeps serving.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from itertools import chain
from typing import Any

from lmcache.integration.vllm.lazy_offload_manager import LazyOffloadActions
from lmcache.integration.vllm.lmcache_mp_metadata import LMCacheMPRequestMetadata

from connector.shell import blocks
from connector.shell.beside import Beside, guard_pool
from connector.shell.feeding import CoreFeed
from connector.shell.hooks import hook
from connector.shell.logs import get_logger
from connector.shell.lookahead import Lookahead, missing_chunk_keys
from connector.shell.narrator import Narrator, counters_line
from connector.shell.pool_commands import PoolCommands
from connector.shell.step_reading import StepReader
from connector.shell.stores import StoreBuilder, StoreSource
from offload_fsm import OffloadConfig, Policy, new_state
from offload_fsm.after_failure import DrainOnly
from offload_fsm.queries import finish_waits, has_in_flight, keeps_stepping
from offload_fsm.vocabulary import events
from offload_fsm.vocabulary.errors import CommandFailed, StepFailed


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
        event_log: Any = None,
        clock: Callable[[], float] = time.monotonic,
        fingerprint: blocks.Fingerprint | None = None,
        run: str = "",
        beside_model: bool = False,
    ) -> None:
        """``event_log``: where applied events are recorded (the hand-off,
        ``connector.handoff.sender.Handoff``, in vLLM; an in-process
        ``EventRecorder`` in tests and benches; None with the log off).
        ``fingerprint``: of a block hash (default ``blocks.fingerprinter``).
        ``run``: the log's file prefix, in every warning about a request;
        ``beside_model``: the step's pass on a thread of its own
        (``connector.shell.beside``), else inside ``on_scheduler_step``."""
        self._beside = Beside(threaded=beside_model, failed=self.hook_failed)
        self._pending_pass: Callable[[], None] | None = None  # see :meth:`start_pass`
        self.config = config
        self._fingerprint = fingerprint if fingerprint is not None else blocks.fingerprinter()
        self.state = new_state(config, world_size=world_size)
        self._group_tokens_per_block = [t for t in group_tokens_per_block if t > 0]
        # Chunk-level dedup needs one block stride; with several KV groups the
        # flat block list has none, so ops are then deduplicated whole.
        single = len(group_tokens_per_block) == 1 and chunk_tokens > 0
        self._blocks_per_chunk = chunk_tokens // group_tokens_per_block[0] if single else 0
        # The most blocks one schedule() can hand out for its token budget.
        self._reader = StepReader(self._group_tokens_per_block, self._fingerprint)
        self._step_budget_blocks = self._reader.blocks_for(step_budget_tokens)
        self._lookahead = Lookahead(self._reader, step_budget_tokens)
        self._clock = clock
        self._pool: Any = None
        self._closed = False
        self._log = get_logger()
        self._commands = PoolCommands(StoreBuilder(group_tokens_per_block), self._fingerprint,
                                      self._log.error)
        self._drain: DrainOnly | None = None
        # When vLLM's shutdown signal came (shell clock), and whether the core heard it.
        self._shutdown_signal_s: float | None = None
        self._shutdown_fed = False
        self._signal_seen = False
        self._late: DrainOnly | None = None  # the drain after an early seal
        self._hooks_failed: set[str] = set()
        self._narrator = Narrator(self._log, clock, run=run)
        self._core = CoreFeed(self.state, self._reader, self._commands, self._narrator,
                              event_log, self.hook_failed)

    @property
    def events_applied(self) -> int:
        """How many events the core has applied (and the log numbered)."""
        self.settle()
        return self._core.seq

    def settle(self) -> None:  # whoever reads ``state`` from outside calls this first
        self.start_pass()
        self._beside.settle()

    def start_pass(self) -> None:
        """Start the pass :meth:`on_scheduler_step` left, once LMCache's ``build_connector_meta``
        is done (the pass must not take the GIL while the step needs it); any hook does it."""
        pending, self._pending_pass = self._pending_pass, None
        if pending is not None:
            self._beside.start(pending)

    event_log = property(lambda self: self._core.event_log,
                         doc="Where applied events are recorded (``__init__``'s).")

    @property
    def draining(self) -> bool:
        """Whether the shell stopped offloading and only drains (see above)."""
        self.settle()
        return self._drain is not None

    # -- the LMCache manager interface -----------------------------------

    def bind_block_pool(self, gpu_block_pool: Any) -> None:
        """vLLM's scheduler hands the connector its ``BlockPool``, once, before
        the first step (LMCache's ``bind_gpu_block_pool``). We keep it for
        the pool commands and log the policy line of the spec. A second,
        different pool is refused (raises): the core's block ids would name
        two pools' blocks."""
        if self._pool is not None and self._pool is not gpu_block_pool:
            raise ValueError("lazy offload is already bound to a different GPU block pool")
        if self._pool is None:
            blocks.report_resets(gpu_block_pool, self.reset_prefix_cache)
            if self._beside.threaded:
                guard_pool(gpu_block_pool, self._beside)
        self._pool = self._commands.pool = gpu_block_pool
        self._narrator.enabled(self.config)

    @hook(lambda: None)
    def offer_chunks(self, req_id: str, start_token: int, end_token: int,
                     group_block_ids: list[list[int]], source: StoreSource) -> None:
        """A request computed ``[start_token, end_token)`` (whole chunks, in
        order, starting where its last offer ended), held in each KV group's
        ``group_block_ids``; ``source`` is what its STOREs take.

        Called by the connector's lazy store-candidate path
        (``connector.shell.candidates``) while LMCache builds the step's metadata,
        before ``on_scheduler_step``, whose pass buffers the range
        (``CandidateOffered`` with the blocks' fingerprints); never stored now."""
        if self._pool is None:
            raise ValueError("lazy offload GPU block pool is not bound")
        if self._drain is None:
            self._core.defer(functools.partial(self._offer, req_id, start_token, end_token,
                                               group_block_ids, source, self._clock()))

    def add_store_candidate(self, metadata: LMCacheMPRequestMetadata) -> None:
        """LMCache's manager interface: ``metadata``'s STORE op as an offer
        (:meth:`offer_chunks`), its token list copy as the source."""
        op: Any = metadata.op
        tokens = op.token_ids
        self.offer_chunks(metadata.request_id, op.start, op.end, op.block_ids,
                          StoreSource(tokens, len(tokens), metadata.cache_salt,
                                      metadata.request_configs))

    @hook(LazyOffloadActions)
    def on_scheduler_step(self, scheduler_output: Any) -> LazyOffloadActions:
        """Called once per ``schedule()``, from ``build_connector_meta``, after
        this step's offers and before the metadata goes to the workers;
        ``scheduler_output`` is read, never changed, and read only until the
        next hook. Runs this step's pass (:meth:`_pass`) now, or leaves it
        for :meth:`start_pass` beside the model, and returns the stores and
        sessions to end of the passes finished by then. Never raises."""
        step_pass = functools.partial(self._pass, scheduler_output, self._clock())
        if not self._beside.threaded:
            self._beside.start(step_pass)
        else:
            self._pending_pass = step_pass
        return self._commands.take_actions()

    def _pass(self, scheduler_output: Any, time_s: float) -> None:
        """The step's pass (``beside``): what waits, the step (:meth:`_step`)
        and its commands, the record; drain-only, it settles what is in flight."""
        if self._drain is not None:
            self._commands.execute_drained(self._drain.step(time_s))
        elif self._pool is not None:
            self._guarded(self._step, (scheduler_output, time_s))
        self._core.record()

    @hook(LazyOffloadActions)
    def on_store_results(
        self, failed_request_ids: set[str], completed_store_counts: dict[str, int]
    ) -> LazyOffloadActions:
        """Called from ``update_connector_output`` every step with the
        workers' store receipts (per request, how many workers finished its
        store; the requests whose store failed on some worker). An empty
        call applies nothing. Otherwise ``ReceiptsArrived`` (beside the model,
        applied first by the next pass or feed): a batch every worker
        reported is settled, its pins released; a failure drops the
        request's later buffered ops. Returns the sessions to end. Never raises."""
        if self._drain is not None:
            self._commands.execute_drained(
                self._drain.receipts(completed_store_counts, failed_request_ids))
        elif completed_store_counts or failed_request_ids:  # vLLM calls every step
            receipts = events.ReceiptsArrived(
                completed=tuple(sorted(completed_store_counts.items())),
                failed=tuple(sorted(failed_request_ids)))
            if self._beside.threaded:
                self._core.defer(receipts)
            else:
                self._guarded(self._core.feed, receipts)
                self._core.record()
        return self._commands.take_sessions()

    @hook(LazyOffloadActions)
    def on_request_finished(self, request_id: str) -> LazyOffloadActions:
        """Called from ``request_finished``, before vLLM frees the request's
        blocks (they join the free queue's tail next). ``RequestFinished``
        with the free-queue length now: the policy may shield the request's
        buffered ops (pin them) before ``schedule()`` can reallocate them.
        Applied now where it shields; beside the model, one that shields nothing
        waits for the next pass. Returns the sessions to end. Never raises."""
        if self._drain is not None:
            self._commands.execute_drained(self._drain.finished(request_id))
        else:
            self._guarded(self._finish, request_id)
        return self._commands.take_sessions()

    @hook(lambda: None)
    def on_request_reset(self, request_id: str) -> None:
        """LMCache recreates a preempted request's tracker (it restarts at
        token 0). ``RequestPreempted``: its buffered ops are dropped, a batch in
        flight orphaned (its receipts still release its pins). Never raises."""
        if self._drain is None:
            self._guarded(self._core.feed, events.RequestPreempted(req_id=request_id))

    @hook(LazyOffloadActions)
    def on_request_arrived(self, request_id: str) -> LazyOffloadActions:
        """LMCache creates a request's tracker (a new request, or an id reused
        while the predecessor's teardown was deferred). ``RequestArrived``;
        returns the predecessor's session to end first, if any. Never raises."""
        if self._drain is not None:
            self._drain.arrived(request_id)
        else:
            self._guarded(self._arrive, request_id)
        return self._commands.take_sessions()

    @hook(lambda: False)
    def has_inflight_store_work(self) -> bool:
        """vLLM asks (``Scheduler.has_requests`` through LMCache's
        ``has_pending_push_work``) whether to keep stepping with no request:
        yes while a store awaits receipts, shields hold pins, a configured
        tail flush has work, or events (a finish, receipts) wait for the next
        pass. After vLLM's shutdown signal, the first "no"
        seals the log (:meth:`_seal_early`). Reads only; never raises."""
        # Read once, first: the SIGTERM hook runs between any two bytecodes of
        # this thread, and a signal that lands after "no work" was computed
        # must not seal the log with the tail unflushed; the next call flushes.
        signal_seen = self._signal_seen
        if self._drain is not None:
            busy = self._drain.busy
        elif self._shutdown_signal_s is not None and not self._shutdown_fed:
            # ShutdownBegan is fed on the next step: step once more if it has work.
            busy = bool(self.state.ready) or has_in_flight(self.state)
        else:
            busy = keeps_stepping(self.state, self._clock())
        busy = busy or (self._drain is None and self._core.waiting)
        if not busy and signal_seen and not self._closed and (
                self._drain is not None or not has_in_flight(self.state)):
            self._seal_early()
        return busy

    @hook(lambda: None, settle=False)  # a signal handler must not wait for the pass
    def shutdown_began(self) -> None:
        """vLLM's engine got SIGTERM/SIGINT (``shutdown_signal``): noted, and with a
        shutdown flush on, its time (the next step feeds ``ShutdownBegan``)."""
        self._signal_seen = True
        if self._shutdown_signal_s is None and self.config.shutdown_flush_s > 0:
            self._shutdown_signal_s = self._clock()

    def _seal_early(self) -> None:
        """After the signal, vLLM leaves its busy loop at our first "no work",
        stops its workers, then calls our shutdown, and kills the engine 5 s
        after the signal: so the ledger line and the log's END are written
        now, nothing in flight. A later callback finds a drain-only shell."""
        self._close()
        self._late = self._drain = DrainOnly(world_size=self.state.world_size,
                                             lease_s=self.config.receipt_lease_s)

    @hook(lambda: None)
    def log_final_stats(self) -> None:
        """vLLM's connector shutdown (LMCache's ``shutdown``). Feeds
        ``ShutdownRequested`` (what is buffered is dropped and counted, what
        is in flight abandoned), logs the final counters line of the spec and
        hands the log its END; after an early seal, settles what came in
        since. Idempotent; never raises."""
        if not self._closed:
            self._close()
            return
        late = self._late
        if late is not None:  # sealed early: settle what came after
            self._commands.execute_drained(late.shutdown())
            if late.stats.sessions_ended or late.stats.abandoned_batches:
                self._narrator.drained("lazy offload: after the log was sealed at shutdown",
                                       late)

    def _close(self) -> None:
        self._closed = True
        try:
            if self._drain is None:
                self._guarded(self._core.feed, events.ShutdownRequested())
                self._commands.submitted.clear()  # shutdown abandoned every batch it held
                self._commands.drop_stores()  # not handed to LMCache yet: abandoned too
                self._narrator.left_at_shutdown(self.state,
                                                signal_seen=self._shutdown_signal_s is not None)
            if self._drain is not None:
                self._commands.execute_drained(self._drain.shutdown())
                self._narrator.drained("lazy offload drained at shutdown", self._drain)
            self._log.info(f"Lazy offload final counters: {counters_line(self.state)}")
        finally:  # whatever went wrong above, the log gets its END
            self._core.record()
            if self._core.event_log is not None:
                # A closed state's digest means nothing to replay.
                self._core.event_log.close(self.state if self._drain is None else None)
            self._beside.close()  # what comes after runs on vLLM's thread

    @hook(lambda: None)
    def reset_prefix_cache(self) -> None:
        """vLLM reset its prefix cache (the pool's own reset tells us:
        ``blocks.report_resets``): ``PrefixCacheReset`` drops every buffered
        op (cause ``cache_reset``). Never raises."""
        if self._drain is None:
            self._guarded(self._core.feed, events.PrefixCacheReset())

    @hook(lambda: None)
    def on_lookup_result(
        self, request_id: str, hit_tokens: int, block_hashes: Sequence[Any],
        pool_hash: Callable[[Any], Any],
    ) -> None:
        """LMCache's lookup found the first ``hit_tokens`` of ``request_id``'s
        prefix on the server; ``block_hashes`` are the request's full blocks'
        hashes, in order, and ``pool_hash`` turns one into the hash the
        pool's block carries. The chunks past the hit that the core remembers
        stored are gone from the server (``lookahead.missing_chunk_keys``):
        ``ChunksMissing``. Needs one block stride (a single KV group). Never
        raises."""
        per_chunk = self._blocks_per_chunk
        if self._drain is not None or self._closed or not per_chunk:
            return
        first = hit_tokens // (per_chunk * self._group_tokens_per_block[0])  # chunks hit
        keys = missing_chunk_keys(  # the core's stored-content memory, read only
            self.state.stored_keys, block_hashes[(first + 1) * per_chunk - 1 :: per_chunk],
            pool_hash, self._fingerprint)
        if keys:
            self._guarded(self._core.feed, events.ChunksMissing(chunk_keys=keys))

    @hook(lambda: None)
    def on_lookup_answered(self, request_id: str, *, prompt_tokens: int, local_tokens: int,
                           hit_tokens: int, loads_async: bool) -> None:
        """LMCache answered ``request_id``'s lookup (``hit_tokens`` to load
        beyond its ``local_tokens`` prefix-cache hit, asynchronously or not)
        and vLLM allocates for it next, in this ``schedule()``. Under
        EVICTION_AWARE, while buffered ops exist, reads how far into the free
        queue that allocation can reach (``connector.shell.lookahead``) and,
        when a buffered block lies within, feeds ``LookupAnswered``: the core
        protects what it can of them before the allocation. Never raises."""
        state = self.state
        if self._drain is not None or self._closed or self._pool is None or not state.owners \
                or self.config.policy is not Policy.EVICTION_AWARE \
                or (request_id not in state.requests and not self._core.arriving(request_id)):
            return
        event = self._lookahead.answered(
            state, self._pool, request_id, prompt_tokens=prompt_tokens,
            local_tokens=local_tokens, hit_tokens=hit_tokens, loads_async=loads_async)
        if event is not None:
            self._guarded(self._core.feed, event)

    # -- observations -----------------------------------------------------

    def _offer(self, req_id: str, start: int, end: int, group_block_ids: list[list[int]],
               source: StoreSource, time_s: float) -> events.CandidateOffered:
        """An offer as the core takes it, built where it is applied."""
        self._commands.stores.offered(req_id, start, end, group_block_ids, source)
        block_ids = tuple(group_block_ids[0]) if len(group_block_ids) == 1 else \
            tuple(chain.from_iterable(group_block_ids))
        return events.CandidateOffered(
            req_id=req_id, start_token=start, end_token=end, block_ids=block_ids,
            block_hashes=blocks.hashes_of(self._pool, block_ids, self._fingerprint),
            time_s=time_s, blocks_per_chunk=self._blocks_per_chunk,
        )

    def _step(self, step: tuple[Any, float]) -> None:
        """One scheduler step: a ``StepScheduled`` (the core plans a drain),
        or, when the core says the step passes (``queries.step_passes``: no
        buffered block in the window, nothing reallocated, shielded, overdue
        or at its lease), one more step in the run the next ``StepsPassed``
        reports: no core step and nothing recorded now."""
        scheduler_output, time_s = step
        if self._shutdown_signal_s is not None and not self._shutdown_fed:
            self._shutdown_fed = True
            self._core.feed(events.ShutdownBegan(
                time_s=max(self._shutdown_signal_s, self.state.time_s)))
            self._log.info("lazy offload: vLLM is shutting down; flushing the buffered tail",
                           ready_requests=len(self.state.ready),
                           wait_s=self.config.shutdown_flush_s)
        self._core.apply_pending()
        seen = self._reader.read(self.state, scheduler_output, self._pool, time_s=time_s)
        if seen is not None:
            self._core.feed(seen)
        elif self._reader.run_full:
            self._core.report_passed()
        self._lookahead.stepped()
        self._narrator.end_of_step(self.state)
        self._commands.stores.pack()  # the sources of requests finished since the last pass

    def _finish(self, request_id: str) -> None:
        self._commands.stores.finished(request_id)
        free = blocks.free_count(self._pool) if self._pool is not None else 0
        finished = events.RequestFinished(req_id=request_id, free_blocks=free,
                                          next_step_max_blocks=self._step_budget_blocks)
        if self._beside.threaded and finish_waits(
                self.state, request_id, free_blocks=free,
                next_step_max_blocks=self._step_budget_blocks, passed=self._reader.passed):
            self._core.defer(finished)
        else:
            self._core.feed(finished)

    def _arrive(self, request_id: str) -> None:
        if request_id not in self.state.requests:  # nothing to end now: applied with the step
            self._core.defer(events.RequestArrived(req_id=request_id))
            return
        ended_before = self._commands.sessions_to_end
        self._core.feed(events.RequestArrived(req_id=request_id))
        if request_id in self._commands.ends_sessions_since(ended_before):
            self._log.info("lazy offload: request id reused while its predecessor's teardown "
                           "was deferred; released the predecessor's session",
                           req_id=request_id)

    # -- failure: drain-only mode -----------------------------------------

    def hook_failed(self, name: str, error: Exception) -> None:
        if name not in self._hooks_failed:
            self._hooks_failed.add(name)
            self._log.error("lazy offload: a call from vLLM failed; vLLM goes on (logged "
                            "once per call)", call=name, reason=repr(error))

    def _guarded(self, method: Callable[[Any], None], argument: Any) -> None:
        try:
            method(argument)
        except Exception as error:  # never let a failure reach vLLM's engine loop
            try:
                self._fail(error)
            except Exception as secondary:  # the last resort: stop, say so, go on
                if self._drain is None:
                    self._drain = DrainOnly(world_size=self.state.world_size,
                                            lease_s=self.config.receipt_lease_s)
                self._log.error("lazy offload stopped; taking over the failure failed",
                                reason=repr(error), secondary=repr(secondary))

    def _fail(self, error: Exception) -> None:
        event: Any = error.event if isinstance(error, StepFailed) else None
        reason = getattr(error, "reason", None) or f"{type(error).__name__}: {error}"
        self._core.record_failure(error, self._log.error)
        self._reader.passed.clear()  # the core is closed: they have nowhere to go
        unexecuted = error.unexecuted if isinstance(error, CommandFailed) else ()
        self._drain, commands = DrainOnly.take_over(
            self.state, self._commands.submitted, self._commands.held, self._clock(), unexecuted)
        self._commands.execute_drained(commands)
        self._commands.stores.clear()
        # Observed, never applied: drain-only takes no offer, an arrival waits
        # only for an id with nothing in flight (a reused one applies at once),
        # and receipts settle what the drain now holds.
        for pending in self._core.drop_pending():
            if type(pending) is events.ReceiptsArrived:
                self._commands.execute_drained(self._drain.receipts(
                    dict(pending.completed), set(pending.failed)))
        self._narrator.stopped(self._drain, seq=self._core.seq, event=event, reason=reason)
