"""The machine's counters: one typed name each, in a fixed order.

``State.counters`` maps every :class:`Counter` to an int, in declaration
order (the counters log line and ``digest.state_digest`` depend on it). The
members are string enums whose values are the wire- and log-stable names,
so readers may index with either the member or its name. Counters that
depend on a cause or a reason are looked up in the tables below, never
built as strings at run time.
"""

from __future__ import annotations

import enum
from typing import Final

from offload_fsm.vocabulary.decisions import DropCause, HoldReason, RejectReason, SelectReason


class Counter(enum.StrEnum):
    ADMITTED_OPS = "admitted_ops"
    ADMITTED_TOKENS = "admitted_tokens"
    REJECTED_UNHASHED_OPS = "rejected_unhashed_ops"
    REJECTED_PREFIX_BROKEN_OPS = "rejected_prefix_broken_ops"
    SELECTED_OPS = "selected_ops"
    SELECTED_OVERDUE_OPS = "selected_overdue_ops"
    SELECTED_CASCADE_OPS = "selected_cascade_ops"
    SELECTED_SHIELDED_OPS = "selected_shielded_ops"
    SHIELDED_OPS = "shielded_ops"
    REJECTED_ALREADY_STORED_OPS = "rejected_already_stored_ops"
    SUBMITTED_OPS = "submitted_ops"
    SUBMITTED_TOKENS = "submitted_tokens"
    STORED_OPS = "stored_ops"
    STORED_TOKENS = "stored_tokens"
    FAILED_OPS = "failed_ops"
    FAILED_TOKENS = "failed_tokens"
    ABANDONED_OPS = "abandoned_ops"
    ABANDONED_TOKENS = "abandoned_tokens"
    DROPPED_EVICTED_OPS = "dropped_evicted_ops"
    DROPPED_PREEMPTED_OPS = "dropped_preempted_ops"
    DROPPED_ID_REUSE_OPS = "dropped_id_reuse_ops"
    DROPPED_STORE_FAILED_OPS = "dropped_store_failed_ops"
    DROPPED_STALE_OPS = "dropped_stale_ops"
    DROPPED_CACHE_RESET_OPS = "dropped_cache_reset_ops"
    DROPPED_SHUTDOWN_OPS = "dropped_shutdown_ops"
    DROPPED_DUPLICATE_OPS = "dropped_duplicate_ops"
    DROPPED_EVICTED_TOKENS = "dropped_evicted_tokens"
    DROPPED_PREEMPTED_TOKENS = "dropped_preempted_tokens"
    DROPPED_ID_REUSE_TOKENS = "dropped_id_reuse_tokens"
    DROPPED_STORE_FAILED_TOKENS = "dropped_store_failed_tokens"
    DROPPED_STALE_TOKENS = "dropped_stale_tokens"
    DROPPED_CACHE_RESET_TOKENS = "dropped_cache_reset_tokens"
    DROPPED_SHUTDOWN_TOKENS = "dropped_shutdown_tokens"
    DROPPED_DUPLICATE_TOKENS = "dropped_duplicate_tokens"
    HELD_DRAIN_CAP = "held_drain_cap"
    HELD_PIN_BUDGET = "held_pin_budget"
    HELD_IN_FLIGHT = "held_in_flight"
    RECEIPTS_IGNORED = "receipts_ignored"
    PROTECTED_BLOCKS = "protected_blocks"
    RELEASED_BLOCKS = "released_blocks"
    TOKEN_STEPS = "token_steps"
    EMPTY_STEPS = "empty_steps"
    WINDOW_BLOCKS_READ = "window_blocks_read"
    BLOCKS_CHECKED = "blocks_checked"
    # Counters added after schema 1 go below this line, and only there: the
    # state digest takes the ones above by position and these by name once
    # non-zero, so the digests of logs recorded before a counter existed
    # stay valid (``digest.canonical_state``).
    ABANDONED_BATCHES = "abandoned_batches"  # receipt lease expired
    HELD_CLAIMED = "held_claimed"  # dedup: waited for another request's batch to settle
    FORGOTTEN_CHUNKS = "forgotten_chunks"  # stored chunks a lookup showed missing
    # The tail flush (``tail_flush``): its cost in extra writes, and what shutdown left.
    IDLE_FLUSHES = "idle_flushes"  # empty steps on which the idle flush selected
    IDLE_FLUSH_OPS = "idle_flush_ops"  # ops it selected (each is one more write)
    IDLE_FLUSH_TOKENS = "idle_flush_tokens"
    SHUTDOWN_FLUSH_OPS = "shutdown_flush_ops"  # ops selected after vLLM began shutting down
    SHUTDOWN_FLUSH_TOKENS = "shutdown_flush_tokens"
    SHUTDOWN_LEFT_OPS = "shutdown_left_ops"  # buffered, verifying or in flight at shutdown
    SHUTDOWN_LEFT_TOKENS = "shutdown_left_tokens"
    SHUTDOWN_LEFT_REQUESTS = "shutdown_left_requests"
    SPLIT_OPS = "split_ops"  # ops cut at a chunk boundary (each rest is also admitted)
    SPLIT_TOKENS = "split_tokens"  # tokens left behind the cut, buffered as the rest
    LOOKUP_SHIELDED_OPS = "lookup_shielded_ops"  # protected at a lookup (LookupAnswered)

    # Hashed on every counter update: Enum's __hash__ runs in Python and returns
    # hash(value); str's C hash gives the same value, so names still index.
    __hash__ = str.__hash__


FIRST_LATER_COUNTER: Final = 44  # the members through BLOCKS_CHECKED: the digest's base
assert list(Counter)[FIRST_LATER_COUNTER - 1] is Counter.BLOCKS_CHECKED


DROPPED_OPS: Final = {cause: Counter(f"dropped_{cause.value}_ops") for cause in DropCause}
DROPPED_TOKENS: Final = {cause: Counter(f"dropped_{cause.value}_tokens") for cause in DropCause}
REJECTED: Final = {reason: Counter(f"rejected_{reason.value}_ops") for reason in RejectReason}
HELD: Final = {reason: Counter(f"held_{reason.value}") for reason in HoldReason}
# Selections counted beside ``selected_ops`` (window and FIFO picks have no own counter).
SELECTED_BY: Final = {
    SelectReason.OVERDUE: Counter.SELECTED_OVERDUE_OPS,
    SelectReason.CASCADE: Counter.SELECTED_CASCADE_OPS,
    SelectReason.SHIELDED: Counter.SELECTED_SHIELDED_OPS,
    SelectReason.IDLE_FLUSH: Counter.IDLE_FLUSH_OPS,
    SelectReason.SHUTDOWN_FLUSH: Counter.SHUTDOWN_FLUSH_OPS,
}


def new_counters() -> dict[Counter, int]:
    """Every counter at zero, in declaration order."""
    return dict.fromkeys(Counter, 0)
