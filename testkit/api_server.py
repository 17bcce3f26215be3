"""vLLM's OpenAI-compatible server as a subprocess on loopback, for tests.

:func:`running_api_server` starts ``python -m vllm.entrypoints.openai.api_server``
with the tiny model and a KV-transfer config, logs to ``log_path``, waits for
``/health``, yields the port, and always stops the server (SIGTERM, then SIGKILL
after 60 s). :func:`get` and :func:`post_json` are the plain HTTP helpers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
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


@contextmanager
def running_api_server(model_dir: Path, kv_transfer_config: dict[str, Any],
                       log_path: Path, extra_args: tuple[str, ...] = (),
                       extra_env: dict[str, str] | None = None) -> Iterator[int]:
    """The server, ready; yields its port. Fails the test if it exits or never
    becomes healthy (with the log's tail). ``extra_args`` go on its command
    line (``--data-parallel-size 2``, say), ``extra_env`` into its environment."""
    import pytest

    port = free_port()
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--block-size", "32", "--max-model-len", "2048",
        "--enable-prefix-caching", "--enforce-eager", "--num-gpu-blocks-override", "128",
        "--kv-transfer-config", json.dumps(kv_transfer_config), *extra_args,
    ]
    with log_path.open("wb") as log:
        # Unbuffered: vLLM logs to stdout, and a server that has to be killed at the
        # end would otherwise lose the buffered lines the test reads.
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})}
        # An in-process LLM() of an earlier test leaves its own (since deleted)
        # Prometheus multiprocess directory in os.environ; the server makes its own.
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while True:
                if server.poll() is not None:
                    pytest.fail(f"api server exited early:\n{log_path.read_text()[-4000:]}")
                try:
                    if get(f"http://127.0.0.1:{port}/health")[0] == 200:
                        break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    pytest.fail(f"api server not ready:\n{log_path.read_text()[-4000:]}")
                time.sleep(1.0)
            yield port
        finally:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
