"""vLLM's KV events with our connector, as a router's subscriber receives them.

vLLM publishes KV cache events over ZMQ (``kv_events_config``, publisher
``zmq``, a ``tcp://*:PORT`` bind); a pyzmq SUB thread here, what a router
(llm-d, Dynamo) runs, decodes every batch with vLLM's own ``KVEventBatch`` type
and stamps its arrival. LMCache-tier events (medium ``"CPU"``, 256-token chunks,
LMCache's chunk hashes) come from LMCache's worker; vLLM's own (medium ``"GPU"``,
32-token blocks) from its block pool.

Workload: 8 prompts sharing a 512-token system prompt (1112 tokens each) on a
72-block pool, two at a time, prefilled in 256-token steps, lazy EVICTION_AWARE
tuned to lose some (``chunk_split`` off, so a shield that cannot cover a whole
op covers none; one op a step; a 1-step horizon): some buffered ops are
dropped as duplicates of another request's chunks, the tail at shutdown, and
usually some as evicted (how many depends on when the server's receipts
release the pins: 2-4 in most runs, none in about one run of ten on a
loaded box, so the test needs no eviction).

* The LMCache server started with ``--kv-event-log-size 0`` (it advertises no
  event stream, so the workers announce their own completed stores): the CPU
  ``BlockStored`` hashes are exactly the chunks the event log (replayed)
  records as stored, as many as ``stored_tokens / 256``, none for a dropped
  op's chunks; every block of a stored chunk is GPU-resident when the chunk is
  announced, and vLLM's GPU ``BlockRemoved`` that ends that residency comes in
  a later batch. The delays are printed (min / median / max) with one chunk's
  events. No start-up warning.
* The default server (it advertises its stream, but vLLM-CPU's engine_driven
  transfer binds no tokens, so the stream stays empty): no CPU event arrives
  although chunks are stored, and the connector's start-up warning (naming
  both fixes) is in the engine log exactly once.
"""

from __future__ import annotations

import collections
import os
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from connector.shell.kv_events import (
    ENGINE_DRIVEN,
    LMCACHE_DRIVEN,
    blind_servers,
    resolve_transfer_mode,
    warning_text,
)
from testkit.engine import shutdown as engine_shutdown
from testkit.engine import tiny_llm
from testkit.engine_log import ENV as ENGINE_LOG_ENV
from testkit.engine_log import engine_log_tail
from testkit.lmcache_server import LMCacheServer, free_port
from tests.e2e.test_connector import our_kv_transfer_config, shared_prefix_prompts

pytestmark = pytest.mark.e2e

CHUNK = 256
BLOCK = 32
POOL_BLOCKS = 72
STEP_TOKENS = 256  # max_num_batched_tokens: prompts prefill over several steps
PAIR = 2
MAX_TOKENS = 8
LAZY = {
    "lmcache.mp.lazy_offload_policy": "EVICTION_AWARE",
    "lmcache.mp.lazy_offload_chunk_split": False,
    "lmcache.mp.lazy_offload_horizon_steps": 1.0,
    "lmcache.mp.lazy_offload_max_drain_per_step": 1,
}
QUIET_S = 1.5  # no batch for this long: the engine has published what it had
SETTLE_TIMEOUT_S = 30.0
WARNING_MARK = "KV events: vLLM publishes KV cache events, but no LMCache-tier"

Tokens = tuple[int, ...]
Pos = tuple[int, int]  # (batch index, event index): the order the subscriber saw


# -- the subscriber ------------------------------------------------------------


@dataclass
class Batch:
    received_s: float  # time.time() at receipt
    seq: int
    ts: float  # vLLM's batch timestamp
    events: list[Any]


@dataclass
class Subscriber:
    """A router's SUB socket on vLLM's publisher, in a thread."""

    port: int
    topic: str = "kv"
    batches: list[Batch] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    error: BaseException | None = None

    def start(self) -> Subscriber:
        self._thread = threading.Thread(target=self._run, name="kv-sub", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        sock = zmq.Context.instance().socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
            sock.connect(f"tcp://127.0.0.1:{self.port}")
            while not self._stop.is_set():
                if not sock.poll(50):
                    continue
                _topic, seq, payload = sock.recv_multipart()
                batch = decoder.decode(payload)
                self.batches.append(Batch(time.time(), int.from_bytes(seq, "big", signed=True),
                                          batch.ts, list(batch.events)))
        except BaseException as error:  # noqa: BLE001 - reported by the test
            self.error = error
        finally:
            sock.close(linger=0)

    def wait_quiet(self, quiet_s: float = QUIET_S, timeout_s: float = SETTLE_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            last = self.batches[-1].received_s if self.batches else 0.0
            if time.time() - last >= quiet_s:
                return
            time.sleep(0.1)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)


# -- one engine run -------------------------------------------------------------


@dataclass
class Run:
    prompts: list[list[int]]
    batches: list[Batch]
    log_dir: Path
    engine_log: str  # what the engine processes logged during the run ("" if not routed)


def _engine_log_offset() -> int:
    path = os.environ.get(ENGINE_LOG_ENV)
    return Path(path).stat().st_size if path and Path(path).exists() else 0


def _engine_log_since(offset: int) -> str:
    path = os.environ.get(ENGINE_LOG_ENV)
    if not path or not Path(path).exists():
        return ""
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read().decode("utf-8", errors="replace")


def serve(model_dir: Path, server: LMCacheServer, log_dir: Path) -> Run:
    """The workload on a fresh engine with KV events on; shut down cleanly."""
    from vllm import SamplingParams, TokensPrompt
    from vllm.config import KVEventsConfig

    port = free_port()
    subscriber = Subscriber(port).start()
    offset = _engine_log_offset()
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                            endpoint=f"tcp://*:{port}", topic=subscriber.topic)
    prompts = shared_prefix_prompts()
    try:
        llm = tiny_llm(model_dir, our_kv_transfer_config(server, log_dir, **LAZY),
                       pool_blocks=POOL_BLOCKS, max_num_batched_tokens=STEP_TOKENS,
                       kv_events_config=events)
        try:
            sampling = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
            for i in range(0, len(prompts), PAIR):
                llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[i:i + PAIR]],
                             sampling, use_tqdm=False)
            subscriber.wait_quiet()
        finally:
            engine_shutdown(llm)
            del llm
        subscriber.wait_quiet(quiet_s=0.5, timeout_s=5.0)
    finally:
        subscriber.stop()
    assert subscriber.error is None, f"the subscriber failed: {subscriber.error!r}"
    return Run(prompts, list(subscriber.batches), log_dir, _engine_log_since(offset))


# -- reading the events --------------------------------------------------------


@dataclass
class Seen:
    """The event stream, indexed: CPU chunks and GPU blocks by their token prefix."""

    cpu_stored: list[tuple[Tokens, Pos, int]] = field(default_factory=list)  # prefix, pos, hash
    cpu_removed: int = 0
    cleared: int = 0
    gpu_hash: dict[Tokens, int] = field(default_factory=dict)  # block prefix -> hash
    gpu_stored: dict[int, list[Pos]] = field(default_factory=dict)
    gpu_removed: dict[int, list[Pos]] = field(default_factory=dict)


def index_events(batches: list[Batch]) -> Seen:
    """Resolve every ``BlockStored`` to its full token prefix through
    ``parent_block_hash`` (per medium: GPU hashes are vLLM's, CPU ones LMCache's)."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    seen = Seen()
    prefix: dict[str, dict[int, Tokens]] = {"GPU": {}, "CPU": {}}
    for b, batch in enumerate(batches):
        for e, event in enumerate(batch.events):
            pos = (b, e)
            if isinstance(event, BlockStored):
                table = prefix[str(event.medium)]
                parent = event.parent_block_hash
                assert parent is None or parent in table, \
                    f"{event.medium} BlockStored at {pos}: parent {parent} never announced"
                base = () if parent is None else table[parent]
                size = event.block_size
                for k, block_hash in enumerate(event.block_hashes):
                    base = base + tuple(event.token_ids[k * size:(k + 1) * size])
                    table[block_hash] = base
                    if event.medium == "CPU":
                        assert size == CHUNK, event
                        seen.cpu_stored.append((base, pos, block_hash))
                    else:
                        assert size == BLOCK, event
                        seen.gpu_hash[base] = block_hash
                        seen.gpu_stored.setdefault(block_hash, []).append(pos)
            elif isinstance(event, BlockRemoved):
                if event.medium == "CPU":
                    seen.cpu_removed += len(event.block_hashes)
                    continue
                for block_hash in event.block_hashes:
                    seen.gpu_removed.setdefault(block_hash, []).append(pos)
            elif isinstance(event, AllBlocksCleared):
                seen.cleared += 1
    return seen


@dataclass
class Ledger:
    """From the event log (replayed): the chunks stored, and those only dropped."""

    counters: dict[str, int]
    stored: collections.Counter[Tokens]
    dropped: set[Tokens]
    drop_causes: collections.Counter[str]


def read_log(run: Run) -> Ledger:
    from offload_fsm.vocabulary.decisions import OpsDropped, StoreSettled, StoreSubmitted
    from replay.runner import replay

    submitted: dict[int, tuple[str, int, int]] = {}
    stored_ranges: list[tuple[str, int, int]] = []
    dropped_ranges: list[tuple[str, int, int, str]] = []

    def observe(_seq: int, _event: object, outcome: Any, _state: object) -> None:
        for decision in outcome.decisions:
            if isinstance(decision, StoreSubmitted):
                submitted[decision.batch_id] = (decision.req_id, decision.start_token,
                                                decision.end_token)
            elif isinstance(decision, StoreSettled) and not decision.failed:
                stored_ranges.append(submitted[decision.batch_id])
            elif isinstance(decision, OpsDropped):
                dropped_ranges.append((decision.req_id, decision.start_token,
                                       decision.end_token, decision.cause.value))

    result = replay(run.log_dir, observer=observe)
    assert result.ok, (result.divergence, result.damage, result.lost)
    assert result.ended_cleanly, f"no END\n{engine_log_tail()}"
    assert result.state is not None

    def chunks(req_id: str, start: int, end: int) -> list[Tokens]:
        # vLLM numbers requests in submission order ("<n>-<random>").
        prompt = run.prompts[int(req_id.split("-")[0])]
        assert end <= len(prompt) and start % CHUNK == 0, (req_id, start, end)
        return [tuple(prompt[:stop]) for stop in range(start + CHUNK, end + 1, CHUNK)]

    stored = collections.Counter(c for r in stored_ranges for c in chunks(*r))
    dropped = {c for req, start, end, _ in dropped_ranges for c in chunks(req, start, end)}
    causes = collections.Counter(cause for *_, cause in dropped_ranges)
    counters = {str(name.value): int(n) for name, n in result.state.counters.items()}
    return Ledger(counters, stored, dropped - set(stored), causes)


# -- fixtures --------------------------------------------------------------------


@pytest.fixture(scope="module")
def events_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LMCacheServer]:
    """A real server that advertises no event stream: the workers announce their stores."""
    server = LMCacheServer(log_dir=tmp_path_factory.mktemp("lmcache-server-events"),
                           extra_args=["--kv-event-log-size", "0"])
    with server:
        yield server


@pytest.fixture(scope="module")
def lazy_run(tiny_model_dir: Path, events_server: LMCacheServer,
             tmp_path_factory: pytest.TempPathFactory) -> Run:
    return serve(tiny_model_dir, events_server, tmp_path_factory.mktemp("kv-events") / "log")


# -- the decision, without an engine ------------------------------------------------


def test_the_transfer_mode_resolves_as_lmcaches_workers_do() -> None:
    assert resolve_transfer_mode({}, "cpu", {}) == ENGINE_DRIVEN
    assert resolve_transfer_mode({}, "cuda", {}) == LMCACHE_DRIVEN
    assert resolve_transfer_mode({}, "cpu", {"LMCACHE_MP_TRANSFER_MODE": "lmcache_driven"}) \
        == LMCACHE_DRIVEN
    key = {"lmcache.mp.mp_transfer_mode": "LMCache_Driven"}  # the key wins over the env
    assert resolve_transfer_mode(key, "cpu", {"LMCACHE_MP_TRANSFER_MODE": "engine_driven"}) \
        == LMCACHE_DRIVEN


def test_only_a_server_that_streams_to_engine_driven_workers_is_blind() -> None:
    streams = {"tcp://a:1": True, "tcp://b:2": False, "tcp://c:3": None}
    assert blind_servers(ENGINE_DRIVEN, streams) == ["tcp://a:1"]
    assert blind_servers(LMCACHE_DRIVEN, streams) == []
    text = warning_text(["tcp://a:1"], ENGINE_DRIVEN, "cpu")
    assert text.startswith(WARNING_MARK)
    assert "--kv-event-log-size 0" in text
    assert '"lmcache.mp.mp_transfer_mode": "lmcache_driven"' in text


# -- the real engine ------------------------------------------------------------------


def test_cpu_block_stored_are_exactly_the_chunks_the_log_stored(lazy_run: Run) -> None:
    seqs = [batch.seq for batch in lazy_run.batches]
    assert seqs == list(range(len(seqs))), f"the subscriber missed batches: {seqs}"
    seen = index_events(lazy_run.batches)
    ledger = read_log(lazy_run)
    counters = ledger.counters

    announced = collections.Counter(chunk for chunk, _, _ in seen.cpu_stored)
    assert counters["stored_tokens"] > 0, counters
    assert len(seen.cpu_stored) == counters["stored_tokens"] // CHUNK, (
        len(seen.cpu_stored), counters)
    assert announced == ledger.stored, (
        f"announced and not stored: {len(announced - ledger.stored)}, "
        f"stored and not announced: {len(ledger.stored - announced)}")
    # Ops were dropped besides the shutdown's tail (duplicates, and usually some
    # evicted ones), and none of the dropped chunks was announced.
    assert counters["dropped_duplicate_tokens"] > 0, counters
    assert ledger.dropped, ledger.drop_causes
    assert not ledger.dropped & set(announced), ledger.drop_causes
    # --kv-event-log-size 0: the workers announce stores; nothing else on the CPU tier.
    assert seen.cpu_removed == 0 and seen.cleared == 0
    assert WARNING_MARK not in lazy_run.engine_log


def test_gpu_block_removed_follow_the_chunks_cpu_block_stored(
    lazy_run: Run, capsys: pytest.CaptureFixture[str], record_property: Any
) -> None:
    seen = index_events(lazy_run.batches)
    batches = lazy_run.batches
    first_announced: dict[Tokens, tuple[Pos, int]] = {}
    for chunk, pos, chunk_hash in seen.cpu_stored:
        first_announced.setdefault(chunk, (pos, chunk_hash))
    assert first_announced

    delays: dict[Tokens, float] = {}
    steps: dict[Tokens, int] = {}
    earlier_residencies = 0
    removals_after = 0
    for chunk, (pos, _) in first_announced.items():
        for length in range(len(chunk) - CHUNK + BLOCK, len(chunk) + 1, BLOCK):
            block_hash = seen.gpu_hash.get(chunk[:length])
            assert block_hash is not None, \
                f"a block of the chunk announced at {pos} was never GPU-stored"
            stores = [p for p in seen.gpu_stored[block_hash] if p < pos]
            assert stores, f"block {block_hash} announced on CPU at {pos} before its GPU store"
            removals = seen.gpu_removed.get(block_hash, [])
            # Resident when the chunk was announced: no BlockRemoved since its last GPU
            # store (a removal before that store ended an earlier residency).
            between = [p for p in removals if stores[-1] < p < pos]
            assert not between, (
                f"block {block_hash} removed at {between} before its chunk's CPU "
                f"BlockStored at {pos}")
            earlier_residencies += sum(1 for p in removals if p < stores[-1])
            later = [p for p in removals if p > pos]
            removals_after += len(later)
            if later:
                assert later[0][0] > pos[0], "removed in the batch that announced its chunk"
                delay = batches[later[0][0]].received_s - batches[pos[0]].received_s
                if chunk not in delays or delay < delays[chunk]:
                    delays[chunk] = delay
                    steps[chunk] = later[0][0] - pos[0]

    assert delays, "no block of a stored chunk was ever removed from the GPU pool"
    values = sorted(delays.values())
    summary = (f"CPU BlockStored -> first GPU BlockRemoved of the chunk's blocks: "
               f"{len(values)} of {len(first_announced)} stored chunks, "
               f"min {values[0] * 1000:.0f} ms / median {statistics.median(values) * 1000:.0f} ms"
               f" / max {values[-1] * 1000:.0f} ms; batches later min {min(steps.values())} / "
               f"max {max(steps.values())}; GPU BlockRemoved of their blocks: {removals_after} "
               f"after the CPU BlockStored, none between the GPU store the chunk was copied "
               f"from and it, {earlier_residencies} ending earlier residencies")
    record_property("kv_event_delays", summary)
    chunk = sorted(delays, key=delays.__getitem__)[len(delays) // 2]
    with capsys.disabled():
        print(f"\n{summary}\n{excerpt(seen, batches, chunk, first_announced[chunk])}")


def excerpt(seen: Seen, batches: list[Batch], chunk: Tokens,
            announced: tuple[Pos, int]) -> str:
    """One stored chunk's events as the subscriber got them: its blocks' GPU
    BlockStored, its CPU BlockStored, its blocks' first GPU BlockRemoved after."""
    (pos, chunk_hash) = announced
    blocks = [seen.gpu_hash[chunk[:n]] for n in range(len(chunk) - CHUNK + BLOCK,
                                                      len(chunk) + 1, BLOCK)]
    t0 = batches[0].received_s
    rows: dict[int, list[str]] = collections.defaultdict(list)
    for block_hash in blocks:
        stored = [p for p in seen.gpu_stored[block_hash] if p < pos][-1]
        rows[stored[0]].append(f"GPU BlockStored {block_hash}")
        later = [p for p in seen.gpu_removed.get(block_hash, []) if p > pos]
        if later:
            rows[later[0][0]].append(f"GPU BlockRemoved {block_hash}")
    parent = batches[pos[0]].events[pos[1]].parent_block_hash
    rows[pos[0]].append(f"CPU BlockStored {chunk_hash} parent={parent} block_size={CHUNK} "
                        f"token_ids[{len(chunk) - CHUNK}:{len(chunk)}] = "
                        f"{list(chunk[-CHUNK:][:4])}...")
    lines = [f"chunk of tokens [{len(chunk) - CHUNK}, {len(chunk)}) of its prompt, "
             f"{len(blocks)} GPU blocks:"]
    for b in sorted(rows):
        batch = batches[b]
        lines.append(f"  seq={batch.seq} received +{batch.received_s - t0:.3f}s "
                     f"({len(batch.events)} events in the batch)")
        lines += [f"    {row}" for row in rows[b]]
    return "\n".join(lines)


def test_the_default_server_sends_no_cpu_event_and_the_connector_warns_once(
    tiny_model_dir: Path, lmcache_server: LMCacheServer, tmp_path: Path
) -> None:
    run = serve(tiny_model_dir, lmcache_server, tmp_path / "log")
    seen = index_events(run.batches)
    ledger = read_log(run)
    assert ledger.counters["stored_tokens"] > 0, ledger.counters
    assert seen.cpu_stored == [] and seen.cpu_removed == 0, "the default server sent events"
    status = lmcache_server.status().get("kv_events", {})
    assert status.get("enabled") and status.get("log_depth") == 0, status
    if not os.environ.get(ENGINE_LOG_ENV):
        pytest.skip("VLLM_LOGGING_CONFIG_PATH was set by the caller: no engine log to read")
    warnings = [line for line in run.engine_log.splitlines() if WARNING_MARK in line]
    assert len(warnings) == 1, (warnings, engine_log_tail())
    assert " WARNING " in warnings[0] and "EngineCore" in warnings[0], warnings[0]
    assert "--kv-event-log-size 0" in warnings[0]
    assert '"lmcache.mp.mp_transfer_mode": "lmcache_driven"' in warnings[0]
