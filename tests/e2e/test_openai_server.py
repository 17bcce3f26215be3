"""The OpenAI-compatible server with our connector, loaded by name alone through the
``vllm.general_plugins`` entry point (no ``kv_connector_module_path``), against a real
LMCache server: a completion comes back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from testkit.lmcache_server import LMCacheServer, free_port

pytestmark = pytest.mark.e2e

READY_TIMEOUT_S = 180.0


def _get(url: str, timeout_s: float = 2.0) -> int:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return int(response.status)


def _post_json(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_openai_server_completes_with_our_connector(
    tiny_model_dir: Path, lmcache_server: LMCacheServer, tmp_path: Path
) -> None:
    port = free_port()
    kv_transfer_config = {
        "kv_connector": "EventSourcedLMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": lmcache_server.connector_config(
            **{
                "lmcache.mp.lazy_offload": True,
                "lmcache.mp.lazy_offload_log_dir": str(tmp_path / "events"),
            }
        ),
    }
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(tiny_model_dir),
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--block-size", "32", "--max-model-len", "2048",
        "--enable-prefix-caching", "--enforce-eager",
        "--num-gpu-blocks-override", "128",
        "--kv-transfer-config", json.dumps(kv_transfer_config),
    ]
    log_path = tmp_path / "api_server.log"
    with log_path.open("wb") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=os.environ)
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while True:
                if server.poll() is not None:
                    pytest.fail(f"api server exited early:\n{log_path.read_text()[-4000:]}")
                try:
                    if _get(f"http://127.0.0.1:{port}/health") == 200:
                        break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    pytest.fail(f"api server not ready:\n{log_path.read_text()[-4000:]}")
                time.sleep(1.0)
            reply = _post_json(
                f"http://127.0.0.1:{port}/v1/completions",
                {"model": str(tiny_model_dir), "prompt": "the quick brown fox " * 40,
                 "max_tokens": 8, "temperature": 0.0, "ignore_eos": True},
            )
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    assert reply["usage"]["completion_tokens"] == 8, reply
    assert isinstance(reply["choices"][0]["text"], str)
    text = log_path.read_text(errors="replace")
    assert "lazy offload enabled with EVICTION_AWARE policy" in text
