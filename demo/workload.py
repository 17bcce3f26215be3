"""The shared-prefix multi-turn chat workload of the demo and of
``bench/side_by_side.py``: sessions over one system prompt, two sessions at a
time, each turn appending a user message and the model's reply; then, after
``reset_prefix_cache()``, each session's last turn replayed alone so that every
hit comes from LMCache."""

from __future__ import annotations

import random
import time
from typing import Any

SYSTEM_TOKENS = 512
USER_TOKENS = 160
SESSIONS = 6
TURNS = 3
REPLY_TOKENS = 16
VOCAB = range(3, 2048)  # the tiny model's vocabulary, minus special tokens


def chat(llm: Any, seed: int, on_turn: Any = None) -> list[list[int]]:
    """Run every turn of every session; returns each session's token history."""
    from vllm import SamplingParams, TokensPrompt

    rng = random.Random(seed)
    sampling = SamplingParams(temperature=0.0, max_tokens=REPLY_TOKENS, ignore_eos=True)
    system = [rng.choice(VOCAB) for _ in range(SYSTEM_TOKENS)]
    history = [list(system) for _ in range(SESSIONS)]
    for turn in range(TURNS):
        for session in range(SESSIONS):
            history[session] += [rng.choice(VOCAB) for _ in range(USER_TOKENS)]
        for start in range(0, SESSIONS, 2):
            batch = list(range(start, min(start + 2, SESSIONS)))
            outputs = llm.generate(
                [TokensPrompt(prompt_token_ids=history[s]) for s in batch],
                sampling, use_tqdm=False,
            )
            for s, output in zip(batch, outputs, strict=True):
                history[s] += list(output.outputs[0].token_ids)
        if on_turn is not None:
            on_turn(turn)
    return history


def replay_last_turns(llm: Any, history: list[list[int]], timeout_s: float = 60.0) -> list[int]:
    """Reset vLLM's prefix cache, then resend each session's last prompt alone;
    returns the prompt tokens each got from cache (so, from LMCache)."""
    from vllm import SamplingParams, TokensPrompt

    deadline = time.monotonic() + timeout_s
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise TimeoutError("vLLM's prefix cache never became resettable")
        time.sleep(0.1)
    sampling = SamplingParams(temperature=0.0, max_tokens=REPLY_TOKENS, ignore_eos=True)
    hits = []
    for tokens in history:
        prompt = TokensPrompt(prompt_token_ids=tokens[:-REPLY_TOKENS])
        hits.append(llm.generate([prompt], sampling, use_tqdm=False)[0].num_cached_tokens)
    return hits
