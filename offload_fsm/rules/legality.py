"""Which event is legal when, and which way an op may move: as data.

Three tables, the only place legality lives:

* :data:`MACHINE_LEGAL`: the machine's phase -> the event types it accepts.
  Between callbacks (OPEN) only observations apply; once a step has asked for
  answers (``ReadHashes``/``ReadFreeQueue``) only answers apply until all are
  in (the shell runs each command loop to completion, ``machine.drive``);
  CLOSED (shut down, or poisoned by a failed step) accepts nothing: ``step``
  raises :class:`MachinePoisoned` before the table is consulted.
* :data:`REQUEST_LEGAL`: a request-scoped observation, by the phase of the
  request it names -> ``None`` (legal) or why it is not. Observations that
  name no request (``StepScheduled``, ``ReceiptsArrived``, which names
  several, ``PrefixCacheReset``, ``ShutdownRequested``, ``ShutdownBegan``,
  ``ChunksMissing``, keyed by content) are legal whenever the machine is OPEN.
* :data:`OP_MOVES`: an op's status -> the statuses it may move to
  (:func:`move` is the only writer of ``Op.status``).

Outside the tables, each handler checks the *values* of its event before it
writes anything: non-negative counts and monotonic time (``StepScheduled``),
a window of exactly ``min(danger depth, free blocks)`` blocks, an empty step
without window or reallocations, non-empty contiguous whole-chunk token
ranges with one hash per block (``CandidateOffered``), positive receipt
counts, answers that name an awaited batch or read with the right length.
Receipts for a request with nothing in flight are not illegal: they are
recorded as ``ReceiptIgnored``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Final

from offload_fsm.state import Op, OpStatus, Phase, State
from offload_fsm.vocabulary.errors import InvalidEvent, MachinePoisoned
from offload_fsm.vocabulary.events import (
    ANSWER_TYPES,
    OBSERVATION_TYPES,
    CandidateOffered,
    Event,
    LookupAnswered,
    RequestArrived,
    RequestFinished,
    RequestPreempted,
)


class MachinePhase(enum.Enum):
    OPEN = "open"  # between callbacks: observations apply
    AWAITING_ANSWERS = "awaiting_answers"  # a step asked for answers
    CLOSED = "closed"  # shut down or poisoned

    # Keys hot tables: Enum's __hash__ runs in Python; members are singletons,
    # so the C identity hash is equivalent (and much faster).
    __hash__ = object.__hash__


class RequestPhase(enum.Enum):
    UNKNOWN = "unknown"  # never arrived, or ended and forgotten
    ACTIVE = "active"
    FINISHED = "finished"  # finished, teardown deferred behind buffered or in-flight ops

    # Keys hot tables: Enum's __hash__ runs in Python; members are singletons,
    # so the C identity hash is equivalent (and much faster).
    __hash__ = object.__hash__


MACHINE_LEGAL: Final[dict[MachinePhase, frozenset[type]]] = {
    MachinePhase.OPEN: frozenset(OBSERVATION_TYPES),
    MachinePhase.AWAITING_ANSWERS: frozenset(ANSWER_TYPES),
    MachinePhase.CLOSED: frozenset(),
}

_U, _A, _F = RequestPhase.UNKNOWN, RequestPhase.ACTIVE, RequestPhase.FINISHED
REQUEST_LEGAL: Final[dict[tuple[type, RequestPhase], str | None]] = {
    (RequestArrived, _U): None,  # a new request
    (RequestArrived, _A): None,  # back after a preemption (already reset)
    (RequestArrived, _F): None,  # id reuse: the predecessor's teardown was deferred
    (CandidateOffered, _U): "store candidate for a request that never arrived",
    (CandidateOffered, _A): None,
    (CandidateOffered, _F): "store candidate after the request finished",
    (RequestFinished, _U): None,  # nothing was buffered: end its session now
    (RequestFinished, _A): None,
    (RequestFinished, _F): "request finished twice",
    (RequestPreempted, _U): None,  # nothing buffered: nothing to drop
    (RequestPreempted, _A): None,
    (RequestPreempted, _F): "a finished request was preempted",
    (LookupAnswered, _U): "a lookup by a request that never arrived",
    (LookupAnswered, _A): None,
    (LookupAnswered, _F): "a lookup after the request finished",
}

_S = OpStatus
OP_MOVES: Final[dict[OpStatus, frozenset[OpStatus]]] = {
    _S.BUFFERED: frozenset({_S.VERIFYING, _S.DROPPED}),
    _S.VERIFYING: frozenset({_S.IN_FLIGHT, _S.DROPPED}),
    _S.IN_FLIGHT: frozenset({_S.STORED, _S.FAILED, _S.ABANDONED}),
}


def machine_phase(state: State) -> MachinePhase:
    if state.closed is not None:
        return MachinePhase.CLOSED
    if state.awaiting_hashes or state.awaiting_queue:
        return MachinePhase.AWAITING_ANSWERS
    return MachinePhase.OPEN


def request_phase(state: State, req_id: str) -> RequestPhase:
    rec = state.requests.get(req_id)
    if rec is None:
        return RequestPhase.UNKNOWN
    return RequestPhase.FINISHED if rec.phase is Phase.FINISHED else RequestPhase.ACTIVE


# The tables above, keyed for the legal case (derived here, never edited):
# event type -> the machine phase that accepts it, and for request-scoped
# types, request phase -> reason (None: legal).
_ACCEPTED_IN: Final[dict[type, MachinePhase]] = {
    event_type: phase for phase, types in MACHINE_LEGAL.items() for event_type in types
}
_REQUEST_REASONS: Final[dict[type, dict[RequestPhase, str | None]]] = {
    event_type: {phase: reason for (of, phase), reason in REQUEST_LEGAL.items() if of is event_type}
    for event_type, _ in REQUEST_LEGAL
}


def check(state: State, event: Event) -> None:
    """Raise unless the tables allow ``event`` now; writes nothing.

    Every step asks, so the legal case is one lookup per table (the tables
    keyed by event type above); anything else goes to :func:`_refuse`, which
    reads the tables as written and says why."""
    event_type = type(event)
    open_ = not (state.awaiting_hashes or state.awaiting_queue)
    if state.closed is None and _ACCEPTED_IN.get(event_type) is (
            MachinePhase.OPEN if open_ else MachinePhase.AWAITING_ANSWERS):
        reasons = _REQUEST_REASONS.get(event_type)
        if reasons is None:
            return
        if reasons.get(request_phase(state, event.req_id)) is None:  # type: ignore[union-attr]
            return
    _refuse(state, event)


def _refuse(state: State, event: Event) -> None:
    """:func:`check` from the tables as written: raises with the reason (and
    returns when they allow ``event``)."""
    name = type(event).__name__
    phase = machine_phase(state)
    if phase is MachinePhase.CLOSED:
        raise MachinePoisoned(f"{name} after the machine closed: {state.closed}")
    req_id: str | None = getattr(event, "req_id", None)
    if type(event) not in MACHINE_LEGAL[phase]:
        if phase is MachinePhase.AWAITING_ANSWERS:
            why = (f"answers are outstanding (hashes for batches {list(state.awaiting_hashes)}, "
                   f"free queue {state.awaiting_queue})")
        else:
            why = "no answer was asked for"
        raise InvalidEvent(event.TAG, req_id, f"{name} arrived in phase {phase.value}: {why}")
    if req_id is None:
        return
    rphase = request_phase(state, req_id)
    reason = REQUEST_LEGAL.get((type(event), rphase))
    if reason is not None:
        raise InvalidEvent(
            event.TAG, req_id, f"{name} for a request in phase {rphase.value}: {reason}"
        )


def move(state: State, ops: Iterable[Op], status: OpStatus) -> None:
    """Move ops to ``status``, keeping ``state.live_ops``/``live_tokens``; a
    move outside :data:`OP_MOVES` is a core bug."""
    live_ops, live_tokens = state.live_ops, state.live_tokens
    into = status in live_ops
    for op in ops:
        was = op.status
        if status not in OP_MOVES.get(was, frozenset()):
            raise AssertionError(
                f"op {op.op_id} of request {op.req.req_id!r} cannot move "
                f"from {was.value} to {status.value}"
            )
        op.status = status
        tokens = op.tokens
        live_ops[was] -= 1  # every move starts from a live status (OP_MOVES)
        live_tokens[was] -= tokens
        if into:
            live_ops[status] += 1
            live_tokens[status] += tokens
