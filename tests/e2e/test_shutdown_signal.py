"""A SIGTERM the kernel hands to one of the engine core's other threads still
shuts the engine down, and the event log is sealed (``connector.shell.shutdown_signal``).

vLLM 0.32's idle engine core waits on its input queue with no timeout; CPython
runs its SIGTERM handler only on the main thread, when it wakes. A process-directed
signal may land on any thread, and one that lands elsewhere leaves the engine
running until its manager kills it, with no END in our log (vLLM's own behaviour:
it happens with no KV connector too). Here ``tgkill`` sends it to another thread of
a real engine running our connector, and nothing else wakes the engine: the test
process waits for it to exit on its own."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest

from testkit.engine import shutdown as engine_shutdown
from testkit.engine import signal_thread, tiny_llm
from testkit.engine_log import ENV as ENGINE_LOG_ENV
from testkit.engine_log import engine_log_tail
from testkit.lmcache_server import LMCacheServer
from tests.e2e.test_connector import our_kv_transfer_config

pytestmark = pytest.mark.e2e

EXIT_WITHIN_S = 30.0  # a loaded 2-core box; it exits in about a second when heard
FORWARDED = "did not hear a signal; sent it to the main thread signal=SIGTERM"


def _exits(pid: int, within_s: float) -> bool:
    """The process is gone or a zombie within ``within_s``. Read from /proc, not
    ``Process.is_alive``: vLLM's client, seeing its engine exit, reaps it itself,
    and a handle that did not reap it reports it alive for ever."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            return True
        if "\nState:\tZ" in status:
            return True
        time.sleep(0.2)
    return False


def _takes_sigterm(pid: int, tid: int) -> bool:
    """The thread does not block SIGTERM (the kernel hands it only such threads)."""
    status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
    (blocked,) = (line.split()[1] for line in status.splitlines() if line.startswith("SigBlk:"))
    return not int(blocked, 16) & (1 << (int(signal.SIGTERM) - 1))


def test_a_sigterm_to_another_engine_thread_shuts_the_engine_down_and_seals_the_log(
    tiny_model_dir: Path, lmcache_server: LMCacheServer, tmp_path: Path,
) -> None:
    from vllm import SamplingParams, TokensPrompt

    from replay.runner import replay

    log_dir = tmp_path / "events"
    llm = tiny_llm(tiny_model_dir, our_kv_transfer_config(lmcache_server, log_dir),
                   pool_blocks=96)
    try:
        rng = random.Random(3)
        prompt = TokensPrompt(prompt_token_ids=[rng.randrange(3, 2048) for _ in range(300)])
        llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        (engine,) = llm.llm_engine.engine_core.resources.engine_manager.processes
        time.sleep(1.0)  # idle: the main thread waits on its input queue
        others = sorted(tid for tid in map(int, os.listdir(f"/proc/{engine.pid}/task"))
                        if tid != engine.pid and _takes_sigterm(engine.pid, tid))
        assert others, "the engine core has no thread but its main one that takes SIGTERM"
        assert signal_thread(engine.pid, others[-1], int(signal.SIGTERM))
        assert _exits(engine.pid, EXIT_WITHIN_S), (
            f"the engine did not hear a SIGTERM sent to its thread {others[-1]} in "
            f"{EXIT_WITHIN_S:.0f}s:\n{engine_log_tail()}")
    finally:
        engine_shutdown(llm)
        del llm
    sealed = replay(log_dir)
    assert sealed.ok and sealed.ended_cleanly, (sealed.divergence, sealed.damage)
    log_path = os.environ.get(ENGINE_LOG_ENV)
    if log_path:  # the engine said why (unless the caller routes vLLM's logs itself)
        lines = Path(log_path).read_text(errors="replace").splitlines()
        assert any(FORWARDED in line and f"pid={engine.pid}" in line for line in lines), \
            engine_log_tail()


def _recorders_of(pid: int) -> list[int]:
    """The recorder processes of engine ``pid``: not its children (they left its
    process tree, ``connector.recorder.detach``); their command line names it."""
    found = []
    mine = f"-m\0connector.recorder\0{pid}\0".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if cmdline.endswith(mine):
            found.append(int(entry))
    return found


def test_an_engine_killed_with_sigkill_leaves_a_log_that_says_so(
    tiny_model_dir: Path, lmcache_server: LMCacheServer, tmp_path: Path,
) -> None:
    """SIGKILL to vLLM's engine core: its recorder process writes what it
    received, ends the log with VANISHED and exits; replay verifies up to it."""
    from vllm import SamplingParams, TokensPrompt

    from logfiles.runs import run_files
    from offload_fsm.log.framing import Record, scan
    from offload_fsm.log.records import VANISHED
    from offload_fsm.log.wire import unpackb
    from replay.runner import replay

    log_dir = tmp_path / "events"
    llm = tiny_llm(tiny_model_dir, our_kv_transfer_config(lmcache_server, log_dir),
                   pool_blocks=96)
    try:
        rng = random.Random(4)
        prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(3, 2048) for _ in range(300)])
                   for _ in range(3)]
        llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        (engine,) = llm.llm_engine.engine_core.resources.engine_manager.processes
        (recorder,) = _recorders_of(engine.pid)
        time.sleep(0.5)  # the last step reaches the recorder
        os.kill(engine.pid, signal.SIGKILL)
        assert _exits(engine.pid, EXIT_WITHIN_S)
        assert _exits(recorder, EXIT_WITHIN_S), "the recorder outlived its engine"
    finally:
        engine_shutdown(llm)
        del llm
    last = [item for item in scan(run_files(log_dir)[-1].read_bytes())][-1]
    assert isinstance(last, Record) and unpackb(last.payload)[0] == VANISHED
    result = replay(log_dir)
    assert result.divergence is None and result.rejection is None and not result.damage
    assert "the engine vanished after event" in result.vanished
    assert result.events_applied > 0
