"""The simulator's model time (``SimParams.model_ms``): each step sleeps that long
between ``schedule()`` and ``update_from_output()``, as vLLM's engine-core thread
waits for its executor, and the sleep lands in no timer: the scheduler's time per
step stays what the two calls took, never negative and never the sleep."""

from __future__ import annotations

from testkit.env import require_stack

require_stack()  # skips without vLLM and LMCache; fails under CI=true

from bench.sim.arms import ArmSpec, SimParams  # noqa: E402
from bench.sim.loop import Sim  # noqa: E402
from bench.sim.workload import WorkloadParams, generate  # noqa: E402

MODEL_MS = 100.0


def test_model_time_is_slept_between_the_scheduler_calls_and_timed_by_neither() -> None:
    workload = WorkloadParams(name="model-time", seed=5, n_chat=2, n_agent=0, n_burst=0,
                              arrival_window_steps=2, chat_turns=(1, 1), chat_decode_median=4)
    params = SimParams(num_gpu_blocks=200, max_num_seqs=4, seed=1, max_steps=200,
                       model_ms=MODEL_MS)
    sim = Sim(ArmSpec(name="eager", kind="stock",
                      extra=(("lmcache.mp.lazy_offload", False),)),
              generate(workload), params)
    result = sim.run()
    assert result.steps > 0 and len(result.sched_ms) == result.steps
    assert result.wall_s >= result.steps * MODEL_MS / 1e3  # the sleeps happened
    assert min(result.sched_ms) >= 0.0, result.sched_ms
    assert max(result.sched_ms) < MODEL_MS, result.sched_ms  # and are in no step's time
