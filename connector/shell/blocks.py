"""The connector's view of vLLM's ``BlockPool``: the only module that touches
block objects. Everything it hands the core is plain ints.

* :func:`hashes_of` turns each block's ``BlockHashWithGroupId`` (hash bytes
  plus a 4-byte group id; None while the block is unhashed) into a 64-bit
  fingerprint (:func:`fingerprinter`). Two different contents collide with
  probability 2^-64 per comparison; the core compares a block only against
  its own snapshot. The log records fingerprints, so replay is exact.

Fingerprints are keyed by a secret of this run that never leaves the
process, because vLLM's block hashes depend only on content: an unkeyed
fingerprint in a log would let its reader test whether a prompt prefix was
served, and link requests across runs. By default the key is CPython's own
per-process SipHash key (``hash(bytes)``, which CPython caches on the bytes
object: a block is hashed once however often it is read). Where
``PYTHONHASHSEED`` fixes that key (vLLM's proof scripts set it), a keyed
BLAKE2b with a random 128-bit key of this process is used instead. A test or
bench that needs byte-identical logs across runs sets the key itself
(:data:`KEY_ENV`, hex); nothing sets it by default.
* :func:`report_resets` makes the pool say when its prefix cache was reset.
* :func:`free_queue_head` walks the free queue from the eviction head and
  stops after ``depth`` blocks: O(depth), never the whole queue.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Callable, Iterable
from typing import Any, Final

BlockPool = Any  # vllm.v1.core.block_pool.BlockPool (kept untyped: vLLM is optional here)
Fingerprint = Callable[[Any], int]

KEY_ENV: Final = "LAZY_OFFLOAD_FINGERPRINT_KEY"


def fingerprinter(environ: dict[str, str] | None = None) -> Fingerprint:
    """This run's fingerprint of a block hash (see the module docstring)."""
    env = os.environ if environ is None else environ
    given = env.get(KEY_ENV, "")
    if given:
        try:
            return _keyed(bytes.fromhex(given))
        except ValueError:
            raise ValueError(f"{KEY_ENV}={given!r} is invalid: expected a hex string of 1 "
                             "to 64 bytes") from None
    if env.get("PYTHONHASHSEED", "random") not in ("", "random"):
        return _keyed(secrets.token_bytes(16))
    return hash


def _keyed(key: bytes) -> Fingerprint:
    if not 1 <= len(key) <= 64:
        raise ValueError(f"{KEY_ENV}: a key of {len(key)} bytes; expected 1 to 64")
    blake2b, from_bytes = hashlib.blake2b, int.from_bytes

    def fingerprint(block_hash: Any) -> int:
        digest = blake2b(block_hash, key=key, digest_size=8).digest()
        return from_bytes(digest, "little", signed=True)

    return fingerprint


def hashes_of(pool: BlockPool, block_ids: Iterable[int],
              fingerprint: Fingerprint = hash) -> tuple[int | None, ...]:
    blocks = pool.blocks
    out = []
    for block_id in block_ids:
        block_hash = blocks[block_id].block_hash
        out.append(None if block_hash is None else fingerprint(block_hash))
    return tuple(out)


def free_queue_head(pool: BlockPool, depth: int) -> tuple[int, ...]:
    """The first ``depth`` block ids of the free queue, eviction head first."""
    if depth <= 0:
        return ()
    queue = pool.free_block_queue
    tail = queue.fake_free_list_tail
    block = queue.fake_free_list_head.next_free_block
    out: list[int] = []
    while block is not None and block is not tail and len(out) < depth:
        out.append(block.block_id)
        block = block.next_free_block
    return tuple(out)


def touch(pool: BlockPool, block_ids: Iterable[int]) -> None:
    pool.touch([pool.blocks[b] for b in block_ids])


def release(pool: BlockPool, block_ids: Iterable[int]) -> None:
    pool.free_blocks([pool.blocks[b] for b in block_ids])


def free_count(pool: BlockPool) -> int:
    return int(pool.get_num_free_blocks())


def report_resets(pool: BlockPool, reported: Callable[[], None]) -> None:
    """Make ``pool.reset_prefix_cache`` call ``reported`` after every reset
    that succeeded. vLLM's ``Scheduler.reset_prefix_cache`` resets the pool
    and calls the connector only with ``reset_connector=True`` (which also
    clears LMCache's own cache), so this is the one place that sees every
    reset: without it a reset reaches the core only as the stale stores it
    causes, and the log cannot say why they were stale."""
    reset = pool.reset_prefix_cache

    def reset_prefix_cache(*args: Any, **kwargs: Any) -> Any:
        done = reset(*args, **kwargs)
        if done:
            reported()
        return done

    pool.reset_prefix_cache = reset_prefix_cache
