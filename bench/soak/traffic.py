"""The soak's clients: multi-turn chat sessions on vLLM's ``/v1/completions``.

Contract. :class:`Traffic` runs ``concurrency`` client threads (plain ``urllib``) until
a monotonic deadline and records every request it completed (start time from the arm's
``t0``, latency, prompt, cached and completion tokens) and every error by type. It
never raises out of a client thread: a failed request ends its session. The same seed
gives the same prompts and the same session shapes in every arm.

Theory of operation. Each thread runs sessions back to back with token-id prompts: a
session picks one of 4 shared system prompts (512-1,024 tokens), runs 2-8 turns, each
turn a 32-256-token user message appended to the conversation so far (system, earlier
messages and the model's earlier replies, by their token ids), 16-128 generated tokens
(greedy, ``ignore_eos``), 0.5-3 s of think time between turns. Token ids make the
conversation's prefix exact, so each turn can reuse its session's KV. The GPU block
pool is ``--blocks`` 32-token blocks (default 256, 8,192 tokens) against about 8 live
sessions of up to 4,096 tokens: vLLM evicts all the time, so EVICTION_AWARE stores and
later turns hit LMCache.
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from typing import Any

from bench.soak.engine import MAX_MODEL_LEN

VOCAB = (3, 2048)  # skip <unk>, <s>, </s>


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*VOCAB) for _ in range(n)]


def system_prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [_tokens(rng, rng.randint(512, 1024)) for _ in range(4)]


class Traffic:
    """``concurrency`` threads of multi-turn sessions until ``deadline`` (monotonic)."""

    def __init__(self, port: int, model: str, seed: int, concurrency: int,
                 deadline: float, t0: float, gate: threading.Event | None = None) -> None:
        """``gate``: waited on before each request (``bench.soak.turns``); None: no wait."""
        self.gate = gate
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
            if self.gate is not None:
                self.gate.wait()
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
