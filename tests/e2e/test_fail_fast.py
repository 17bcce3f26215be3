"""A malformed lazy-offload config fails before vLLM loads any weight: ``LLM(...)``
in a subprocess with ``lmcache.mp.lazy_offload_threshold: 0``, or with lazy offload on
and prefix caching off; its log must carry our error (the same message the connector's
constructor gives) and no weight-loading line before it. Before the checks moved to
class resolution and the finished config (``connector.shell.plugin``), the errors came from
the connector (its ``__init__``, or a class method the workers call), after the model
had loaded."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ERROR = "lmcache.mp.lazy_offload_threshold=0 is invalid: expected an integer >= 1"
NO_PREFIX_CACHING = ("lmcache.mp.lazy_offload requires vLLM prefix caching: start vLLM with "
                     "--enable-prefix-caching")
WEIGHT_LINES = ("Starting to load model", "Loading weights took", "Model loading took",
                "Loading model weights")

SCRIPT = textwrap.dedent("""
    import sys
    from vllm import LLM
    LLM(model=sys.argv[1], dtype="float32", block_size=32, max_model_len=2048,
        enable_prefix_caching=sys.argv[3] == "on", enforce_eager=True,
        num_gpu_blocks_override=64,
        kv_transfer_config={
            "kv_connector": "EventSourcedLMCacheMPConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": int(sys.argv[2]),
                "lmcache.mp.lazy_offload": True,
                "lmcache.mp.lazy_offload_threshold": int(sys.argv[4])}})
""")


def _first(lines: list[str], needles: tuple[str, ...]) -> int | None:
    for index, line in enumerate(lines):
        if any(needle in line for needle in needles):
            return index
    return None


@pytest.mark.parametrize(("prefix_caching", "threshold", "error"), [
    ("on", 0, ERROR),  # a bad key
    ("off", 20, NO_PREFIX_CACHING),  # good keys, but vLLM without prefix caching
], ids=["bad-key", "no-prefix-caching"])
def test_bad_config_fails_before_weights_load(tiny_model_dir: Path, tmp_path: Path,
                                              prefix_caching: str, threshold: int,
                                              error: str) -> None:
    from testkit.lmcache_server import free_port

    log_path = tmp_path / "llm.log"
    with log_path.open("wb") as log:
        code = subprocess.call([sys.executable, "-c", SCRIPT, str(tiny_model_dir),
                                str(free_port()), prefix_caching, str(threshold)],
                               stdout=log, stderr=subprocess.STDOUT, env=os.environ,
                               timeout=300)
    lines = log_path.read_text(errors="replace").splitlines()
    tail = "\n".join(lines[-40:])
    assert code != 0, tail
    error_at = _first(lines, (error,))
    assert error_at is not None, f"our error is missing:\n{tail}"
    weights_at = _first(lines, WEIGHT_LINES)
    assert weights_at is None or error_at < weights_at, f"weights loaded first:\n{tail}"
    # The engine core never started: nothing to load weights in.
    assert _first(lines, ("Initializing a V1 LLM engine",)) is None, tail
