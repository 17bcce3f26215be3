"""A finished request's buffered ops keep no vLLM token list: the next pass
packs the source (``connector.shell.stores``), and the STORE it later
submits carries the same tokens, on a real vLLM ``BlockPool``."""

from __future__ import annotations

import pytest

from testkit.env import require_stack

require_stack()

from offload_fsm import Policy  # noqa: E402
from tests.connector.test_manager_faults import Shell  # noqa: E402


@pytest.mark.parametrize("beside", [False, True])
def test_a_finished_request_is_packed_by_the_next_pass_and_stored_whole(beside: bool) -> None:
    s = Shell(policy=Policy.FIFO, threshold=2, beside=beside)
    s.offer("a", blocks=4)
    s.step()  # as in vLLM: offers come with a step, whose pass applies them
    s.finish("a")  # one finished request: below the threshold, it stays buffered
    stores = s.mgr._commands.stores
    assert "a" in stores._latest  # packed by a pass, not on vLLM's step
    s.step()
    s.mgr.settle()
    assert "a" in stores._packed and "a" not in stores._latest
    s.offer("b")
    s.step()
    s.finish("b")
    s.step()
    s.mgr.settle()
    s.step()  # the stores the last pass submitted go out with this step
    built = {store.request_id: store for store in s.taken}
    assert built["a"].op.token_ids == list(range(4 * 16))
    assert (built["a"].op.start, built["a"].op.end) == (0, 4 * 16)
