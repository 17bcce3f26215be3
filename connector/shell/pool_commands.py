"""The core's commands, carried out against vLLM's ``BlockPool`` and
LMCache's per-step actions; and the shell's own records of what it did.

Contract: :meth:`PoolCommands.execute` runs one command on vLLM's scheduler
thread and returns the event a read command answers with (``HashesRead``,
``FreeQueueRead``), None otherwise; a failing pool call raises (the manager
turns it into drain-only mode). :meth:`PoolCommands.note` keeps the records
in step with the core's decisions. :meth:`PoolCommands.take_actions` hands
LMCache what this call produced, once.

==========================  ===============================================
core command                what is done
==========================  ===============================================
``ProtectBlocks``           ``BlockPool.touch``; counted in ``held``
``ReadHashes``              read ``block.block_hash`` -> ``HashesRead``
``ReadFreeQueue``           walk the free queue head -> ``FreeQueueRead``
``SubmitStore``             one coalesced STORE in this step's metadata
``ReleaseBlocks``           ``BlockPool.free_blocks``; uncounted in ``held``
``EndSession``              returned in ``sessions_to_end``
==========================  ===============================================

The records are what drain-only mode trusts when the core is gone
(``offload_fsm.after_failure``): ``held``, the protections really applied to
the pool (block id -> count), and ``submitted``, the stores handed to LMCache
and not yet settled (req id -> (batch id, block ids)).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lmcache.integration.vllm.lazy_offload_manager import LazyOffloadActions

from connector.shell import blocks
from connector.shell.stores import StoreBuilder
from offload_fsm.rules.pins import decref
from offload_fsm.vocabulary import commands
from offload_fsm.vocabulary.commands import Command
from offload_fsm.vocabulary.decisions import OpRejected, OpsDropped, StoreAbandoned, StoreSettled
from offload_fsm.vocabulary.events import Event, FreeQueueRead, HashesRead
from offload_fsm.vocabulary.outcome import Outcome


class PoolCommands:
    """Carries out the core's commands (module docstring)."""

    def __init__(self, stores: StoreBuilder, fingerprint: blocks.Fingerprint,
                 error: Callable[..., None]) -> None:
        """``error``: logs a drain-only command's failure (a structured logger's ``error``)."""
        self.pool: Any = None
        self._error = error
        self.stores = stores
        self._fingerprint = fingerprint
        self.held: dict[int, int] = {}
        self.submitted: dict[str, tuple[int, tuple[int, ...]]] = {}
        self._actions = LazyOffloadActions()

    def execute(self, command: Command) -> Event | None:
        pool = self.pool
        if isinstance(command, commands.ProtectBlocks):
            blocks.touch(pool, command.block_ids)
            held = self.held
            for block_id in command.block_ids:
                held[block_id] = held.get(block_id, 0) + 1
        elif isinstance(command, commands.ReadHashes):
            hashes = blocks.hashes_of(pool, command.block_ids, self._fingerprint)
            return HashesRead(batch_id=command.batch_id, block_hashes=hashes)
        elif isinstance(command, commands.ReadFreeQueue):
            depth = min(command.depth_blocks, blocks.free_count(pool))
            return FreeQueueRead(window_block_ids=blocks.free_queue_head(pool, depth))
        elif isinstance(command, commands.SubmitStore):
            self._actions.stores_to_submit.append(self.stores.build(command))
            self.submitted[command.req_id] = (command.batch_id, command.block_ids)
        elif isinstance(command, commands.ReleaseBlocks):
            blocks.release(pool, command.block_ids)
            self._unhold(command.block_ids)
        elif isinstance(command, commands.EndSession):
            self._actions.sessions_to_end.append(command.req_id)
            self.stores.forget(command.req_id)
        return None

    def execute_drained(self, drained: list[Command]) -> None:
        """Drain-only mode's commands (releases, session ends); a pool call
        that fails is logged and the rest go on."""
        for command in drained:
            try:
                if isinstance(command, commands.ReleaseBlocks):
                    blocks.release(self.pool, command.block_ids)
                    self._unhold(command.block_ids)
                elif isinstance(command, commands.EndSession):
                    self._actions.sessions_to_end.append(command.req_id)
            except Exception as failure:  # a pool that fails here cannot be helped
                self._error("lazy offload: drain-only command failed",
                            command=type(command).__name__, reason=repr(failure))

    def note(self, outcome: Outcome) -> None:
        """Keep the records in step with the core's decisions: a dropped or
        rejected range is no longer built, a settled batch no longer held."""
        for decision in outcome.decisions:
            if isinstance(decision, OpsDropped | OpRejected):
                if not isinstance(decision, OpsDropped) or decision.ops:
                    self.stores.forget_range(decision.req_id, decision.start_token,
                                             decision.end_token)
            elif isinstance(decision, StoreSettled | StoreAbandoned):
                held = self.submitted.get(decision.req_id)
                if held is not None and held[0] == decision.batch_id:
                    del self.submitted[decision.req_id]

    def ends_sessions_since(self, count: int) -> list[str]:
        """The sessions to end added after the first ``count``."""
        return list(self._actions.sessions_to_end[count:])

    @property
    def sessions_to_end(self) -> int:
        """How many sessions this call's actions end so far."""
        return len(self._actions.sessions_to_end)

    def take_actions(self) -> LazyOffloadActions:
        """The stores and sessions to end so far (for ``on_scheduler_step``)."""
        actions, self._actions = self._actions, LazyOffloadActions()
        return actions

    def take_sessions(self) -> LazyOffloadActions:
        """The sessions to end so far; the stores wait for the next step
        (LMCache takes stores from ``on_scheduler_step`` only)."""
        ended = self._actions.sessions_to_end
        if not ended:
            return LazyOffloadActions()
        self._actions.sessions_to_end = []
        return LazyOffloadActions(sessions_to_end=ended)

    def drop_stores(self) -> None:
        """Forget the stores not yet handed to LMCache (shutdown abandoned them)."""
        self._actions.stores_to_submit.clear()

    def _unhold(self, block_ids: tuple[int, ...]) -> None:
        held = self.held
        for block_id in block_ids:
            if block_id in held:
                decref(held, block_id)
