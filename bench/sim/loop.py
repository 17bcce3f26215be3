"""Scheduler-in-the-loop simulation of one arm: the real vLLM ``Scheduler`` /
``KVCacheManager`` / ``BlockPool`` with the arm's connector built by vLLM's own
factory, fake model outputs, simulated workers and a lookup stand-in for the
LMCache server.

Contract: :class:`Sim` runs one arm (``bench.sim.arms.ArmSpec``) over one
generated workload and one ``SimParams``; :meth:`Sim.run` (or :func:`run_arm`)
steps until every session is done (then at most 50 idle steps for outstanding
receipts and frees) or ``max_steps``, and returns the arm's
``bench.sim.results.ArmResult``. The same arm, workload and parameters make the
same decisions every run; only the timings differ.

Theory of operation, per step::

    release due turns -> scheduler.add_request       (prompts keyed for ground truth)
    so = scheduler.schedule()                        # timed (connector part timed too)
    loss attribution's free-queue snapshot           # ours: here, before its pass runs
                                                     # (LMCache's: in build_connector_meta;
                                                     # only with SimParams.attribute_losses)
    workers: STOREs submitted, receipts after the ranks' delays (maybe failed);
             RETRIEVEs finished now; eager delayed frees once the request's stores
             are done                                # bench.sim.workers
    model: the next scripted token for every request past its prompt
    (SimParams.model_ms, in no timer, asleep after sweeping model_sweep_mib;
     ours' pass runs meanwhile)
    loss attribution: what the drain pinned          # (only with attribute_losses)
    scheduler.update_from_output(so, ModelRunnerOutput)   # timed
    finished turns -> their sessions' next turns; the Request let go

Instrumentation (ground truth, loss attribution, backlog: ``bench.sim.truth``,
wired in by ``bench.sim.hooks`` with this class as the listener) is timed
separately and subtracted from the scheduler and connector times it runs inside
of. As vLLM's engine core does after start-up, the heap built before serving is
frozen out of the cyclic GC's collections, and the collections while serving
are counted and timed into the result. With the event log on, serving starts
once the recorder process is up, and the result is taken after it wrote END
and exited, so it never runs beside the next arm; its CPU is in the result
(``bench.sim.recorder``).
"""

from __future__ import annotations

import gc
import time
from typing import Any

import numpy as np

from bench.sim import hooks, standin
from bench.sim.arms import BLOCK_TOKENS, ArmSpec, SimParams, build_engine
from bench.sim.arrivals import Arrivals
from bench.sim.recorder import RecorderWatch
from bench.sim.results import ArmResult
from bench.sim.truth import GroundTruth, LossAttribution, Retired
from bench.sim.views import ManagerView
from bench.sim.workers import Workers
from bench.sim.workload import Session


class Sim:
    def __init__(self, arm: ArmSpec, sessions: list[Session], params: SimParams,
                 log_dir: str | None = None) -> None:
        self.arm = arm
        self.p = params
        self.clocks = hooks.Clocks()
        self.res = ArmResult(arm=arm.name)
        self._gc_started = 0.0  # the running collection's start (``_collected``)
        floats = params.model_sweep_mib << 18  # 4-byte floats in that many MiB
        self._sweep = (np.ones(floats, dtype=np.float32), np.zeros(floats, dtype=np.float32)) \
            if floats else None  # what the model's stand-in copies from and to
        self.step = 0
        self.lm = standin.SimLMCache(BLOCK_TOKENS, params.world_size,
                                     keeps=params.lookups == "keep")
        # request id -> vLLM Request while it runs, its Retired once finished
        self.requests: dict[str, Any] = {}
        self.lm.requests = self.requests
        engine = build_engine(arm, params, self.lm, log_dir)
        self.scheduler = engine.scheduler
        self.block_hasher = engine.block_hasher
        self.pool = engine.pool
        self.connector = engine.connector
        self.view = ManagerView(self.connector, arm)
        # ours with the log on: its recorder process's CPU (bench.sim.recorder)
        self.recorder = RecorderWatch.of(self.view.mgr) if arm.kind == "ours" else None
        self.truth = GroundTruth(self.lm, self.res)
        self.losses = (LossAttribution(arm, self.view, self.pool, self.requests)
                       if params.attribute_losses else None)
        self.workers = Workers(params, connected=self.connector is not None, lazy=arm.lazy,
                               lm=self.lm, truth=self.truth, pool=self.pool,
                               requests=self.requests, res=self.res)
        hooks.install(pool=self.pool, connector=self.connector, view=self.view,
                      lazy=arm.lazy, clocks=self.clocks, listener=self)
        self.arrivals = Arrivals.start(sessions)

    # -- the hooks' listener (bench.sim.hooks.Listener) ----------------------------------
    def on_evicted(self, block_id: int, bh_group: Any, block_hash: bytes, gone: bool) -> None:
        if gone:
            self.truth.evicted(bytes(block_hash))
        if self.losses is not None:
            self.losses.evicted(block_id, bh_group)

    def on_offered(self, req_id: str, start: int, block_ids: list[int]) -> None:
        if self.losses is not None:
            self.losses.offered(req_id, start, block_ids)

    def before_drain(self) -> None:
        if self.losses is not None:
            self.losses.before_drain()

    def after_drain(self) -> None:
        if self.losses is not None:
            self.losses.after_drain(self.step)

    def on_finished(self, returned: Any, request: Any) -> None:
        rid = request.request_id
        if self.losses is not None:
            self.losses.finished(rid, self.step)
        if returned and returned[0]:  # an eager arm's delayed free
            self.workers.eager_wait_free.add(rid)

    # -- the run -----------------------------------------------------------------------
    def run(self) -> ArmResult:
        """Run the arm until every session is done (plus a short idle tail for
        outstanding receipts) or ``max_steps``; return its result."""
        if self.recorder is not None:
            self.recorder.wait_up()  # as in vLLM: up before the first request
        # As vLLM's EngineCore does after start-up (``freeze_gc_heap``): the heap
        # built so far (here also the workload and the other arms' leftovers)
        # is left out of the cyclic GC's full collections while serving.
        gc.collect()
        gc.freeze()
        started = time.perf_counter()
        gc.callbacks.append(self._collected)
        try:
            self._loop()
        finally:
            gc.callbacks.remove(self._collected)
            gc.unfreeze()
        self.res.wall_s = time.perf_counter() - started
        return self._collect()

    def _collected(self, phase: str, info: dict[str, int]) -> None:
        """``gc.callbacks``: count each collection and time its pause."""
        if phase == "start":
            self.res.gc_collections[info["generation"]] += 1
            self._gc_started = time.perf_counter()
        else:
            self.res.gc_pause_ms += (time.perf_counter() - self._gc_started) * 1e3

    def _loop(self) -> None:
        idle_tail = 0
        while self.step < self.p.max_steps:
            self.step += 1
            self._one_step(self.step)
            if self.arrivals.done:
                busy = self.workers.busy or self.scheduler.has_requests()
                idle_tail += 1
                if not busy or idle_tail > 50:
                    break

    def _one_step(self, step: int) -> None:
        """Arrivals, ``schedule``, the simulated workers and model, ``update_from_output``,
        then finished turns. Scheduler time excludes instrumentation and the simulation
        between the two scheduler calls."""
        res, clocks = self.res, self.clocks
        self._release_due_turns()
        backlog = self.view.backlog()
        res.backlog.append(backlog)
        res.max_backlog = max(res.max_backlog, backlog)
        clocks.conn_s = 0.0
        i0 = clocks.instr_s
        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        t1 = time.perf_counter()
        i1 = clocks.instr_s
        res.max_running = max(res.max_running, len(self.scheduler.running))
        if so.preempted_req_ids:
            res.preemptions += len(so.preempted_req_ids)
        mro = self._model_output(so, self.workers.output(so, step))
        res.computed_tokens += so.total_num_scheduled_tokens
        if self.arm.lazy and self.view.ours:  # ours drains beside the model, from here
            self.before_drain()
        if self.p.model_ms:  # between the two timed calls: in no timer
            model_s = self.p.model_ms / 1e3
            started = time.perf_counter()
            if self._sweep is not None:
                np.copyto(self._sweep[1], self._sweep[0])
            time.sleep(max(0.0, model_s - (time.perf_counter() - started)))
        if self.arm.lazy:  # the drain is over (ours' pass: a pool read waits for it)
            self.after_drain()
        i2 = clocks.instr_s
        t2 = time.perf_counter()
        self.scheduler.update_from_output(so, mro)
        t3 = time.perf_counter()
        instr_dt = (i1 - i0) + (clocks.instr_s - i2)  # only what the two timers include
        res.sched_ms.append(((t1 - t0) + (t3 - t2) - instr_dt) * 1e3)
        res.conn_ms.append(clocks.conn_s * 1e3)
        if so.total_num_scheduled_tokens:
            res.token_steps += 1
        self._retire_finished_turns(step)

    def _make_request(self, rid: str, prompt: list[int], turn: Any) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=turn.decode_len, ignore_eos=True, temperature=0.0)
        return Request(request_id=rid, prompt_token_ids=prompt, sampling_params=sp,
                       pooling_params=None, arrival_time=float(self.step),
                       block_hasher=self.block_hasher)

    def _release_due_turns(self) -> None:
        for rid, prompt, turn, sid in self.arrivals.pop_due(self.step):
            req = self._make_request(rid, prompt, turn)
            self.requests[rid] = req
            self.arrivals.started(rid, req, sid, turn)
            self.truth.register_prompt(req)
            self.scheduler.add_request(req)

    def _retire_finished_turns(self, step: int) -> None:
        done = [rid for rid, (req, _) in self.arrivals.active.items() if req.is_finished()]
        for rid in done:
            self.res.finished_requests += 1
            self.arrivals.finished(rid, step)
            # vLLM lets go of a finished Request (its token lists with it); lazy stores
            # and the loss attribution still need its block hashes, so keep only those.
            self.requests[rid] = Retired(self.requests[rid].block_hashes)

    def _model_output(self, so: Any, kco: Any) -> Any:
        """A fake model step: the next scripted output token for every scheduled
        request past its prompt (``7`` once the script runs out), nothing for the rest."""
        from vllm.v1.outputs import ModelRunnerOutput

        req_ids = list(so.num_scheduled_tokens.keys())
        sampled: list[list[int]] = []
        for rid in req_ids:
            req = self.requests[rid]
            if req.num_computed_tokens >= req.num_tokens:
                toks = self.arrivals.out_tokens[rid]
                i = len(req.output_token_ids)
                sampled.append([toks[i] if i < len(toks) else 7])
            else:
                sampled.append([])
        return ModelRunnerOutput(req_ids=req_ids,
                                 req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled, kv_connector_output=kco)

    def _collect(self) -> ArmResult:
        res = self.res
        res.steps = self.step
        res.unfinished_sessions = self.arrivals.live_sessions
        res.lmcache_hit_tokens = self.lm.hit_tokens
        res.written_keys = len(self.truth.written)
        res.useful_written_keys = len(self.truth.useful & self.truth.written)
        res.ledger = self.view.ledger()
        if self.losses is not None:
            res.losses = self.losses.by_mechanism()
        if self.view.mgr is not None and self.arm.kind == "ours":
            watch = self.recorder
            if watch is not None:
                watch.before_close()
            self.view.mgr.log_final_stats()  # closes the event log
            if watch is not None:
                # until the recorder wrote END and exited, so no recorder of this
                # arm still runs beside the next arm's steps
                watch.after_end()
                handoff = watch.handoff
                res.recorder_cpu_s = watch.serving_cpu_s
                res.recorder_total_cpu_s = watch.total_cpu_s
                res.recorder_drain_s = watch.drain_s
                res.recorder_note = ("restarted" if watch.restarted or
                                     handoff.stats.recorder_restarts else
                                     "" if watch.exited else "did not exit")
                res.log_events_lost = handoff.events_lost
                res.log_bytes_in_flight_max = handoff.stats.bytes_in_flight_max
                res.log_bytes_sent = handoff._flight.sent
        return res


def run_arm(arm: ArmSpec, sessions: list[Session], params: SimParams,
            log_dir: str | None = None) -> ArmResult:
    return Sim(arm, sessions, params, log_dir=log_dir).run()
