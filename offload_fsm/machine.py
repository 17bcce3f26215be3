"""The transition function: ``step(state, event) -> Outcome``, the only writer
of state, and ``drive``, which runs a callback's command loop.

Rules this module keeps
-----------------------
1. Everything that changes state happens inside ``step``, through the
   transition modules it dispatches to (``lifecycle``, ``drain``,
   ``eviction_aware`` and the helpers they share: ``buffer``, ``pins``,
   ``blockindex``, ``dedup``). Planners (``fifo.plan_fifo``, ``ea_planner``),
   ``invariants``, ``digest.state_digest`` and ``queries`` only read.
2. No clock, no randomness, no I/O, no logging. Time arrives on events; ids
   (op, batch, admission order) are counters in the state; iteration follows
   dict insertion order. The same events give the same decisions, commands and
   state digest, in any process.
3. Legality is data (``legality``): the machine's phase and the request's
   phase say which events apply; each handler checks its event's values
   before it writes anything.
4. One poison path: any exception inside a step (an illegal event, a bad
   value, or a bug of the core) poisons the machine (``State.closed`` says
   why) and raises
   :class:`StepFailed` (``InvalidEvent`` or ``CoreFault``) with the event and
   the reason; later steps raise :class:`MachinePoisoned`.
   ``ShutdownRequested`` closes the machine the same way. ``drive`` attaches
   the events it applied before the failure, so the shell logs them and the
   rejection, and ``replay verify`` reproduces the rejection itself.

Theory of operation
-------------------
There are three lifecycles.

*Store op* (one chunk-aligned token range of a request; ``Op.status``, moves
in ``legality.OP_MOVES``)::

    offered --admit--> BUFFERED --select--> VERIFYING --hashes ok--> IN_FLIGHT
       |                  |                     |                       |
       +--> rejected      +--> DROPPED           +--> DROPPED (stale)    +--> STORED | FAILED
          (unhashed,         (evicted, preempted,                          (all workers
           prefix broken,     id reuse, store failed,                       reported)
           already stored)    cache reset, shutdown,                    +--> ABANDONED
                              duplicate)                                     (shutdown)

Selection takes a *front slice* of the request's buffer into one *batch*
(``drain``): protected, re-read, and the valid prefix submitted as one
store; never stale KV. Receipts count up to the world size; then the pins
are released. Any loss breaks the request's prefix chain: later ops are
dropped or rejected, because LMCache retrieves from token 0 and could never
reach them.

*Request* (``lifecycle``): ACTIVE until ``RequestFinished`` (FINISHED);
preemption and id reuse restart the chain and orphan the batch in flight. A
FINISHED request with nothing buffered and no batch ends its session
(``EndSession``) exactly once.

*Step* (``drain.on_step``): a step with tokens updates the shared step
fields and hands over to the policy (``PolicyHooks.token_step``: FIFO's
threshold rule in ``fifo``; the danger window, cascade and shields in
``eviction_aware``). Its commands are answered before the next observation.
A run of token steps that the shell found quiet (no buffered block in
their windows, nothing reallocated, shielded, overdue or past its lease)
arrives as one ``StepsPassed``: each is folded as its ``StepScheduled``
would have been, without a plan (``drain.on_steps_passed``); on a busy
engine with a buffered backlog far from the eviction head, that is most
steps. Within a ``schedule()``, before its step arrives, a waiting request's
answered lookup may come as ``LookupAnswered``: the free-queue blocks the
allocation vLLM makes for it next can reach; EVICTION_AWARE protects the
buffered ops among them (``eviction_aware``, the lookup shield) and the
step's drain selects them first; FIFO refuses it.
A step with zero scheduled tokens selects nothing; it only lifts shields,
unless a tail flush is configured (``tail_flush``: after ``idle_flush_steps``
empty steps in a row, or after ``ShutdownBegan``, the ready requests'
intact buffered ops are selected; off by default).

Ledger (ops; the same holds for tokens)::

    admitted == pending + verifying + in_flight + stored + failed + abandoned
                + sum(dropped_<cause>)
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

from offload_fsm.policies import dedup, eviction_aware
from offload_fsm.policies.registry import hooks_for
from offload_fsm.rules import drain, lifecycle, tail_flush
from offload_fsm.rules.legality import check
from offload_fsm.rules.scope import Scope
from offload_fsm.state import State
from offload_fsm.vocabulary import events
from offload_fsm.vocabulary.commands import Command
from offload_fsm.vocabulary.errors import CommandFailed, CoreFault, MachinePoisoned, StepFailed
from offload_fsm.vocabulary.events import Event
from offload_fsm.vocabulary.outcome import NO_OUTCOME, Outcome

__all__ = ["drive", "step"]


_HANDLERS: dict[type, Callable[[State, Any, Scope], None]] = {
    events.RequestArrived: lifecycle.on_arrived,
    events.CandidateOffered: lifecycle.on_offered,
    events.StepScheduled: tail_flush.on_step,
    events.RequestFinished: lifecycle.on_finished,
    events.RequestPreempted: lifecycle.on_preempted,
    events.ReceiptsArrived: drain.on_receipts,
    events.PrefixCacheReset: lifecycle.on_cache_reset,
    events.ShutdownRequested: lifecycle.on_shutdown,
    events.HashesRead: drain.on_hashes,
    events.FreeQueueRead: eviction_aware.on_queue_read,
    events.ChunksMissing: dedup.on_chunks_missing,
    events.ShutdownBegan: tail_flush.on_shutdown_began,
    events.StepsPassed: tail_flush.on_steps_passed,
    events.LookupAnswered: lifecycle.on_lookup_answered,
}


def step(state: State, event: Event) -> Outcome:
    """Apply one event. See the module docstring for the contract."""
    if state.closed is not None:
        raise MachinePoisoned(f"{type(event).__name__} after the machine closed: {state.closed}")
    handler = _HANDLERS.get(type(event))
    if handler is None:
        raise TypeError(f"not an offload_fsm event: {event!r}")
    scope = Scope(hooks_for(state.config.policy))
    try:
        check(state, event)
        handler(state, event, scope)
        if not state.awaiting_hashes and not state.awaiting_queue:
            state.context = None
    except StepFailed as error:
        error.event = event
        state.closed = str(error)
        raise
    except Exception as error:
        reason = _describe(error, event)
        state.closed = reason
        raise CoreFault(reason, event) from error
    if not scope.decisions and not scope.commands:
        return NO_OUTCOME
    return Outcome(decisions=tuple(scope.decisions), commands=tuple(scope.commands))


def drive(
    state: State,
    event: Event,
    execute: Callable[[Command], Event | None],
) -> list[tuple[Event, Outcome]]:
    """Apply an observation and run its command loop to completion.

    ``execute`` performs each command in order and returns the answer event
    for ``ReadHashes``/``ReadFreeQueue`` (``None`` otherwise). Answers are fed
    back in command order. Returns every (event, outcome) applied, the
    observation first, so the shell can log all inputs. On a failed step the
    :class:`StepFailed` carries them in ``applied``; when ``execute`` raises,
    the machine is poisoned and :class:`CommandFailed` carries them.
    """
    applied: list[tuple[Event, Outcome]] = []
    queue = [event]
    while queue:
        current = queue.pop(0)
        try:
            outcome = step(state, current)
        except StepFailed as error:
            error.applied = tuple(applied)
            raise
        applied.append((current, outcome))
        for index, command in enumerate(outcome.commands):
            try:
                answer = execute(command)
            except Exception as error:
                reason = f"the shell failed to execute {type(command).__name__}: {error!r}"
                state.closed = reason
                failure = CommandFailed(reason, command)
                failure.applied = tuple(applied)
                failure.unexecuted = outcome.commands[index:]
                raise failure from error
            if answer is not None:
                queue.append(answer)
    return applied


def _describe(error: Exception, event: Event) -> str:
    """An unexpected exception as one line: what, where, on which event."""
    frames = traceback.extract_tb(error.__traceback__)
    where = ""
    if frames:
        where = f" at {frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}"
    return (f"core fault while applying {type(event).__name__}: "
            f"{type(error).__name__}{where}: {error}")
