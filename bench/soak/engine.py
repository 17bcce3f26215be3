"""The soak's engine: vLLM's OpenAI API server as a process, and what it shows.

Contract. :func:`api_server` starts ``python -m vllm.entrypoints.openai.api_server``
through ``testkit.api_server`` with the tiny model (``--max-model-len``
:data:`MAX_MODEL_LEN`, a pool of ``blocks`` GPU blocks of 32 tokens) and, where one is
given, a KV-transfer config; it yields (port, pid) once ``/health`` answers and always
stops the server (SIGTERM, then SIGKILL after 90 s). Everything else here reads that
server from outside and never changes it: its processes and their RSS, the log
directory's size, ``/metrics`` (:func:`scrape`, summed by engine or label, the ledger,
the fault counters, the state at the end), and the server log's WARNING and ERROR
lines by kind.

Theory of operation. :class:`Sampler` takes one row every :data:`SAMPLE_EVERY_S`:
engine-core RSS (``VmRSS`` of the API server's child ``VLLM::EngineCore``), the
recorder's (the engine core's child ``python -m connector.recorder``) and the API
server's, the log directory's size and file names, a few gauges and counters from
``/metrics``. The ledger is computed from one scrape as ``tests/e2e/test_metrics.py``
computes it: admitted against dropped + stored + failed + abandoned + what is still
buffered, verifying or in flight, per engine.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.trees import REPO
from testkit.api_server import api_server_process, get

P = "vllm:lazy_offload_"
MAX_MODEL_LEN = 4096
SAMPLE_EVERY_S = 10.0
READY_TIMEOUT_S = 300.0
SETTLE_TIMEOUT_S = 120.0
MIB = 1024 * 1024
# vLLM's histograms of a request's times whose means each arm reports, in the report's order
MEAN_TIMES = ("request_queue_time_seconds", "request_prefill_time_seconds",
              "request_decode_time_seconds", "time_to_first_token_seconds",
              "lmcache_mp_lookup_duration_seconds")


@contextmanager
def api_server(model_dir: Path, kv_transfer_config: dict[str, Any] | None, log_path: Path,
               blocks: int, extra_env: dict[str, str],
               shutdown_timeout: int = 0) -> Iterator[tuple[int, int]]:
    """The OpenAI server, ready, with the soak's context length, pool and shutdown
    timeout, prompt-token details on (the cached share); yields (port, pid)."""
    with api_server_process(
            model_dir, kv_transfer_config, log_path, blocks=blocks,
            max_model_len=MAX_MODEL_LEN, extra_env=extra_env,
            extra_args=("--enable-prompt-tokens-details",
                        "--shutdown-timeout", str(shutdown_timeout)),
            ready_timeout_s=READY_TIMEOUT_S, stop_timeout_s=90.0, cwd=REPO) as server:
        yield server


def processes(api_pid: int) -> dict[str, Any]:
    """The engine core (``EngineCore`` in its title) under the server, and its recorder."""
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
    # The recorder left the engine's tree (connector.recorder.detach); its
    # command line names its engine.
    if "engine" in found:
        mine = ["-m", "connector.recorder", str(found["engine"])]
        for proc in psutil.process_iter(["cmdline"]):
            cmdline = proc.info["cmdline"] or []
            if cmdline[-3:] == mine:
                found["recorder"] = proc.pid
                break
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

    _, text = get(f"http://127.0.0.1:{port}/metrics", timeout_s=10.0)
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

# The colour escapes vLLM writes around a line's level.
ANSI = re.compile(r"\x1b\[[0-9;]*m")
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
        line = ANSI.sub("", raw)
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


# -- sampling ---------------------------------------------------------------------

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
        scraped = {n for n, _ in samples}
        for name in ("pinned_blocks", "in_flight_batches", "buffered_ops", "admitted_ops_total",
                     "stored_ops_total", "log_recorder_up", "log_items_lost",
                     "log_handoff_events_lost"):
            if P + name in scraped:
                row[name] = total(samples, P + name)
        row["preemptions"] = total(samples, "vllm:num_preemptions_total")
        self.samples.append(row)
        return row


# -- after the traffic ------------------------------------------------------------

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
        "engine_steps": total(samples, "vllm:iteration_tokens_total_count"),
        "step_tokens": total(samples, "vllm:iteration_tokens_total_sum"),
    }
    for name in MEAN_TIMES:
        count = total(samples, f"vllm:{name}_count")
        out[f"mean_{name}"] = total(samples, f"vllm:{name}_sum") / count if count else None
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
