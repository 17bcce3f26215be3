"""A drain plan: what a policy's planner decided, as data.

Planners (``fifo.plan_fifo``, ``ea_planner.plan_eviction_aware``) only read
the state and return a :class:`Plan`: which requests' front ops to select
(:class:`Pick`), which due requests to hold and why (:class:`Hold`), and the
budget used; ``drain.apply_plan`` applies it. Every plan takes only front
slices of a request's buffer, at most one batch per request per step, and
nothing for a request whose previous batch is still verifying or in flight.
"""

from __future__ import annotations

from typing import Final

import attrs

from offload_fsm.state import RequestState
from offload_fsm.vocabulary.decisions import HoldReason, SelectReason

EMA_ALPHA = 0.3


def ema_update(previous: float, sample: float) -> float:
    """One step of the exponential moving averages the core keeps (alpha 0.3)."""
    return EMA_ALPHA * sample + (1.0 - EMA_ALPHA) * previous


@attrs.frozen(kw_only=True)
class Pick:
    rec: RequestState
    count: int  # front ops to select
    reason: SelectReason
    rank: int
    split_blocks: int = 0  # cut the last of them after this many blocks first (0: whole)


@attrs.frozen(kw_only=True)
class Hold:
    rec: RequestState
    ops: int
    reason: HoldReason


@attrs.frozen(kw_only=True)
class Plan:
    picks: tuple[Pick, ...]
    holds: tuple[Hold, ...] = ()
    ops_used: int = 0
    headroom_used_blocks: int = 0
    window_pinned: frozenset[int] = frozenset()  # window blocks its picks protect


NO_PLAN: Final = Plan(picks=())
