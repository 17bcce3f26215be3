"""Why does *our* EA lose buffered ops? Event-level evidence from one arm.

Runs ``ours EA`` on one simulator config and, for every request that finished with
ops still buffered, records what the core saw at ``RequestFinished``: the free-queue
length (the rank its freed blocks will take at the tail), the danger depth and the
pin-budget reserve (running requests). Then, for every lost op the simulator
attributed to a mechanism, it says which shield condition in
``offload_fsm.machine._maybe_shield`` let the blind window open, and sums the core's
own drop decisions (``OpsDropped`` by ``DropCause``) and holds (``OpsHeld`` by
``HoldReason``).

    python -m bench.diagnose [--config 0] [--scale small]
"""

from __future__ import annotations

import argparse
from collections import Counter

from bench.sim.arms import ArmSpec, SimParams
from bench.sim.loop import Sim
from bench.sim.workload import generate, make_params
from bench.simulate import SCALES


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--scale", default="small", choices=sorted(SCALES))
    ap.add_argument("--config", type=int, default=0)
    ap.add_argument("--seed", type=int, default=20261129)
    a = ap.parse_args(argv)
    preset, scale, window, label, blocks, seqs = SCALES[a.scale][a.config]
    sessions = generate(make_params(preset, scale, a.seed, window))
    arm = ArmSpec("ours EA", "ours", (("lmcache.mp.lazy_offload", True),
                                      ("lmcache.mp.lazy_offload_policy", "EVICTION_AWARE"),
                                      ("lmcache.mp.lazy_offload_log_dir", "")))
    sim = Sim(arm, sessions, SimParams(num_gpu_blocks=blocks, max_num_seqs=seqs, seed=a.seed,
                                          attribute_losses=True))
    mgr = sim.view.mgr
    at_finish: dict[str, tuple[int, int, int, int]] = {}
    orig_fin = mgr.on_request_finished
    decisions: Counter[str] = Counter()
    orig_feed = mgr._narrator.note

    def note(outcome):  # type: ignore[no-untyped-def]
        for d in outcome.decisions:
            name = type(d).__name__
            cause = getattr(d, "cause", None) or getattr(d, "reason", None)
            n = getattr(d, "ops", 1)
            decisions[f"{name}:{cause.value if cause is not None else ''}"] += n
        return orig_feed(outcome)

    mgr._narrator.note = note

    def fin(rid: str):  # type: ignore[no-untyped-def]
        st = mgr.state
        rec = st.pending.get(rid)
        n_ops = len(rec.ops) if rec is not None else 0
        free = sim.pool.get_num_free_blocks()
        at_finish[rid] = (n_ops, free, st.depth_blocks, st.reserve_blocks)
        return orig_fin(rid)

    mgr.on_request_finished = fin
    # per-step allocation vs the danger depth the core held going into the step
    alloc = [0]
    orig_get = sim.pool.get_new_blocks

    def get_new_blocks(n: int):  # type: ignore[no-untyped-def]
        alloc[0] += n
        return orig_get(n)

    sim.pool.get_new_blocks = get_new_blocks
    over: Counter[str] = Counter()
    orig_sched = sim.scheduler.schedule

    def schedule():  # type: ignore[no-untyped-def]
        depth = mgr.state.depth_blocks
        alloc[0] = 0
        so = orig_sched()
        meta = so.kv_connector_metadata
        loads = sum(1 for m in getattr(meta, "requests", ()) if m.direction == "RETRIEVE")
        if depth and alloc[0] > depth:
            over["steps allocating more than the depth D held before them"] += 1
            if loads:
                over["... of which with LMCache async loads (RETRIEVE) in the step"] += 1
        over["token steps"] += 1 if so.total_num_scheduled_tokens else 0
        return so

    sim.scheduler.schedule = schedule
    res = sim.run()
    print(f"# {preset}/{label} blocks={blocks}: recall {res.recalled}/{res.needed}, "
          f"losses by mechanism {res.losses}")
    why: Counter[str] = Counter()
    for (rid, _start), mech in sim.losses.lost.items():
        if mech != "blind_window":
            continue
        n_ops, free, depth, reserve = at_finish.get(rid, (0, -1, -1, -1))
        if depth == 0:
            why["depth==0 (idle EMA) at finish"] += 1
        elif free >= depth:
            why["free_blocks >= depth at finish (tail outside window), yet reallocated"] += 1
        elif free < reserve:
            why["free_blocks < running requests (pin budget refused the shield)"] += 1
        else:
            why["shield conditions met (should have been shielded)"] += 1
    print("blind-window losses of ours, by the shield condition at RequestFinished:")
    for k, v in why.most_common():
        print(f"  {v:5d}  {k}")
    for k, v in over.items():
        print(f"  {v:5d}  {k}")
    print("core decisions (ops), from Outcome.decisions:")
    for k, v in sorted(decisions.items()):
        if k.startswith(("OpsDropped", "OpsHeld", "OpsShielded", "OpsSelected")):
            print(f"  {v:6d}  {k}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
