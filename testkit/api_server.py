"""vLLM's OpenAI-compatible server as a subprocess on loopback, for tests and benches.

:func:`api_server_process` starts ``python -m vllm.entrypoints.openai.api_server``
with the tiny model (32-token blocks, prefix caching, eager) and, where one is given,
a KV-transfer config; it logs to ``log_path``, waits for ``/health``, yields (port,
pid), and always stops the server (SIGTERM, then SIGKILL after ``stop_timeout_s``).
A server that exits or never becomes healthy raises :class:`ApiServerFailed` with the
log's tail. :func:`running_api_server` is the same for a test: it yields the port and
fails the test instead of raising. :func:`get` and :func:`post_json` are the plain
HTTP helpers.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from testkit.lmcache_server import free_port

READY_TIMEOUT_S = 180.0


def get(url: str, timeout_s: float = 5.0) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return int(response.status), response.read().decode()


def post_json(url: str, body: dict[str, Any], timeout_s: float = 120.0) -> Any:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


class ApiServerFailed(RuntimeError):
    """The server exited before it was healthy, or was not healthy in time; the
    message ends with the tail of its log."""


@contextmanager
def api_server_process(model_dir: Path, kv_transfer_config: dict[str, Any] | None,
                       log_path: Path, *, blocks: int = 128, max_model_len: int = 2048,
                       extra_args: tuple[str, ...] = (),
                       extra_env: dict[str, str] | None = None,
                       ready_timeout_s: float = READY_TIMEOUT_S, stop_timeout_s: float = 60.0,
                       cwd: Path | None = None) -> Iterator[tuple[int, int]]:
    """The server, ready; yields (port, pid). ``kv_transfer_config`` None: no KV
    connector. ``extra_args`` go on its command line (``--data-parallel-size 2``,
    say), ``extra_env`` into its environment."""
    port = free_port()
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--block-size", "32", "--max-model-len", str(max_model_len),
        "--enable-prefix-caching", "--enforce-eager", "--num-gpu-blocks-override", str(blocks),
        *extra_args,
    ]
    if kv_transfer_config is not None:
        command += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    with log_path.open("wb") as log:
        # Unbuffered: vLLM logs to stdout, and a server that has to be killed at the
        # end would otherwise lose the buffered lines the caller reads.
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})}
        # An in-process LLM() of an earlier test leaves its own (since deleted)
        # Prometheus multiprocess directory in os.environ; the server makes its own.
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        # Its own process group: what the server leaves behind when it is stopped
        # before it is ready (its engine core) is killed with the group.
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                  cwd=cwd, start_new_session=True)
        try:
            deadline = time.monotonic() + ready_timeout_s
            while True:
                if server.poll() is not None:
                    raise ApiServerFailed(f"api server exited early:\n{_tail(log_path)}")
                try:
                    if get(f"http://127.0.0.1:{port}/health")[0] == 200:
                        break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise ApiServerFailed(f"api server not ready:\n{_tail(log_path)}")
                time.sleep(1.0)
            yield port, server.pid
        finally:
            server.terminate()
            try:
                server.wait(timeout=stop_timeout_s)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)


@contextmanager
def running_api_server(model_dir: Path, kv_transfer_config: dict[str, Any],
                       log_path: Path, extra_args: tuple[str, ...] = (),
                       extra_env: dict[str, str] | None = None) -> Iterator[int]:
    """:func:`api_server_process` for a test: yields the port; fails the test (with
    the log's tail) where the server exits or never becomes healthy."""
    import pytest

    with ExitStack() as stack:
        try:
            port, _ = stack.enter_context(api_server_process(
                model_dir, kv_transfer_config, log_path, extra_args=extra_args,
                extra_env=extra_env))
        except ApiServerFailed as error:
            pytest.fail(str(error))
        yield port


def _tail(path: Path, n: int = 4000) -> str:
    return path.read_text(errors="replace")[-n:]
