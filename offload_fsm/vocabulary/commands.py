"""Commands: orders for the shell, executed in the order given.

Frozen, keyword-only attrs classes with never-renumbered wire tags (commands
start at 200). Two commands expect an answer event, fed back before any new
observation: ``ReadHashes`` -> ``HashesRead`` and ``ReadFreeQueue`` ->
``FreeQueueRead``.
"""

from __future__ import annotations

from typing import ClassVar

import attrs


@attrs.frozen(kw_only=True)
class ProtectBlocks:
    """Pin the blocks (``BlockPool.touch``) so vLLM cannot reallocate them."""

    TAG: ClassVar[int] = 200
    batch_id: int
    block_ids: tuple[int, ...]


@attrs.frozen(kw_only=True)
class ReadHashes:
    """Read the current hashes of the blocks (after protecting them) and answer
    with ``HashesRead(batch_id, ...)`` in the same order."""

    TAG: ClassVar[int] = 201
    batch_id: int
    block_ids: tuple[int, ...]


@attrs.frozen(kw_only=True)
class SubmitStore:
    """Submit one coalesced store of ``[start_token, end_token)`` for the request
    in this step's connector metadata."""

    TAG: ClassVar[int] = 202
    batch_id: int
    req_id: str
    start_token: int
    end_token: int
    block_ids: tuple[int, ...]


@attrs.frozen(kw_only=True)
class ReleaseBlocks:
    """Unpin blocks protected earlier (``BlockPool.free_blocks``)."""

    TAG: ClassVar[int] = 203
    batch_id: int
    block_ids: tuple[int, ...]


@attrs.frozen(kw_only=True)
class EndSession:
    """End the request's LMCache session: it is finished, nothing is buffered
    and nothing is in flight."""

    TAG: ClassVar[int] = 204
    req_id: str


@attrs.frozen(kw_only=True)
class ReadFreeQueue:
    """Read the first ``depth_blocks`` free-queue block ids again (after this
    step's protections) and answer with ``FreeQueueRead``."""

    TAG: ClassVar[int] = 205
    depth_blocks: int


Command = ProtectBlocks | ReadHashes | SubmitStore | ReleaseBlocks | EndSession | ReadFreeQueue

COMMAND_TYPES: tuple[type[Command], ...] = (
    ProtectBlocks,
    ReadHashes,
    SubmitStore,
    ReleaseBlocks,
    EndSession,
    ReadFreeQueue,
)
