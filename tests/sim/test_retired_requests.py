"""The simulator lets go of a finished request as vLLM does: it keeps only the block
hashes that lazy stores and the loss attribution still read. Keeping every ``Request``
(its token lists with it) would grow the heap for the whole run and bring every arm's
young collections due far more often than in vLLM."""

from __future__ import annotations

import gc
import weakref

from testkit.env import require_stack

require_stack()  # skips without vLLM and LMCache; fails under CI=true

from bench.sim.arms import ArmSpec, SimParams  # noqa: E402
from bench.sim.loop import Sim  # noqa: E402
from bench.sim.workload import WorkloadParams, generate  # noqa: E402


def test_finished_requests_are_let_go_and_their_hashes_kept() -> None:
    workload = WorkloadParams(name="retired", seed=5, n_chat=3, n_agent=0, n_burst=0,
                              arrival_window_steps=2, chat_turns=(2, 2), chat_decode_median=4)
    params = SimParams(num_gpu_blocks=400, max_num_seqs=4, seed=1, max_steps=400)
    sim = Sim(ArmSpec(name="ours", kind="ours",
                      extra=(("lmcache.mp.lazy_offload", True),
                             ("lmcache.mp.lazy_offload_log_dir", ""))),
              generate(workload), params)
    made: list[weakref.ref[object]] = []
    make = sim._make_request

    def watched(*args: object) -> object:
        request = make(*args)  # type: ignore[arg-type]
        made.append(weakref.ref(request))
        return request

    sim._make_request = watched  # type: ignore[method-assign]
    result = sim.run()
    gc.collect()
    assert result.finished_requests == len(made) == 6
    alive = [ref() for ref in made if ref() is not None]
    assert alive == [], f"{len(alive)} finished requests still alive"
    assert all(isinstance(kept.block_hashes, list) and kept.block_hashes
               for kept in sim.requests.values())
