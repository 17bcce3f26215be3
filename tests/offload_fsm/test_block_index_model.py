"""The block index (``blockindex.index`` / ``unindex``, runs of chunks shared
in one ``state.Holders`` entry) against the plainest model of it: each
block's holders, in the order they joined. Ops are drawn over a few shared
chunks as a prefix-cache hit offers them (runs of whole chunks from any
chunk on, ending anywhere), and also out of step with the chunks (shifted by
a block, or holding their blocks out of order), and leave in any order.
Every block keeps one hash, so no op loses its data here (the loss rules
are ``test_block_index``'s)."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from offload_fsm.policies import blockindex
from offload_fsm.policies.eviction_aware import HOOKS
from offload_fsm.rules.scope import Scope
from offload_fsm.state import Holders, Op, RequestState, holders, new_state, pack_ints
from tests.offload_fsm.helpers import ea

SIZE = 3  # blocks per chunk
BLOCKS = tuple(range(100, 100 + 6 * SIZE))  # six chunks' worth


class BlockIndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.state = new_state(ea(), world_size=1)
        self.ops: list[Op] = []
        self.model: dict[int, list[int]] = {}  # block -> holder op ids, in joining order
        self.next_id = 0

    def _index(self, blocks: tuple[int, ...]) -> None:
        rec = RequestState(req_id=f"r{self.next_id}")
        op = Op(op_id=self.next_id, req=rec, start_token=0, end_token=32 * len(blocks),
                packed_ids=pack_ints(blocks), packed_hashes=pack_ints(b * 7 for b in blocks),
                time_s=0.0,
                blocks_per_chunk=SIZE)
        self.next_id += 1
        blockindex.index(self.state, op, op.block_ids, op.block_hashes, Scope(HOOKS))
        self.ops.append(op)
        for block in blocks:
            self.model.setdefault(block, []).append(op.op_id)

    @rule(first=st.integers(0, 5), chunks=st.integers(1, 6), short=st.integers(0, SIZE - 1))
    def offer_chunks(self, first: int, chunks: int, short: int) -> None:
        """Whole chunks from chunk ``first`` on, the last one ``short`` blocks short."""
        blocks = BLOCKS[first * SIZE:(first + chunks) * SIZE]
        self._index(blocks[:len(blocks) - short] if len(blocks) > short else blocks)

    @rule(first=st.integers(0, len(BLOCKS) - 1), length=st.integers(1, 2 * SIZE + 1))
    def offer_shifted(self, first: int, length: int) -> None:
        """Out of step with the chunks: any stretch of blocks."""
        self._index(BLOCKS[first:first + length])

    @rule(first=st.integers(0, 4), data=st.data())
    def offer_out_of_order(self, first: int, data: st.DataObject) -> None:
        blocks = list(BLOCKS[first * SIZE:(first + 2) * SIZE])
        self._index(tuple(data.draw(st.permutations(blocks))))

    @precondition(lambda self: self.ops)
    @rule(data=st.data())
    def drop(self, data: st.DataObject) -> None:
        op = self.ops.pop(data.draw(st.integers(0, len(self.ops) - 1)))
        blockindex.unindex(self.state, [op])
        for block in op.block_ids:
            self.model[block].remove(op.op_id)
            if not self.model[block]:
                del self.model[block]

    @invariant()
    def holders_are_the_models(self) -> None:
        owners = self.state.owners
        got = {b: [op.op_id for op in holders(entry)] for b, entry in owners.items()}
        assert got == self.model
        assert self.state.owner_hashes == {b: b * 7 for b in self.model}

    @invariant()
    def shared_entries_are_whole(self) -> None:
        for block, entry in self.state.owners.items():
            if type(entry) is Holders:
                assert len(entry) >= 2 and block in entry.block_ids
                assert all(self.state.owners[b] is entry for b in entry.block_ids)
                assert entry.block_hashes == tuple(b * 7 for b in entry.block_ids)
            elif isinstance(entry, dict):
                assert len(entry) >= 2, (block, entry)


TestBlockIndex = BlockIndexMachine.TestCase
TestBlockIndex.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
