"""Seeded, deterministic workload generator for the scheduler-in-the-loop simulator.

A workload is a list of *sessions*. Each session is a sequence of *turns*; turn k+1's
prompt is turn k's prompt + turn k's output + a new user/tool message, so later turns
share a long prefix with earlier ones. A turn is released ``pause_steps`` simulator
steps after the previous turn of its session finished (closed loop, so every arm sees
the same content and the same relative timing). Three session kinds:

* ``chat``: one of a few long shared system prompts, a short user message, 2-8 turns,
  decode lengths from a lognormal, pauses of tens to hundreds of steps.
* ``agent``: a longer shared system prompt, many turns with tool outputs appended,
  short decodes, short pauses.
* ``burst``: a single-turn unique long prompt, arriving in bursts; a share of them
  repeat an earlier burst prompt after a delay (a session with two identical turns).

Everything is drawn from one ``random.Random(seed)``: the same seed and parameters give
the same tokens, lengths, arrivals and pauses.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

VOCAB = 32000


@dataclass
class Turn:
    new_tokens: list[int]  # appended to the conversation before this turn's prompt
    decode_len: int
    out_tokens: list[int]
    pause_steps: int  # after the previous turn finished (or session start for turn 0)
    repeat_whole_prompt: bool = False  # burst repeat: same prompt as turn 0, no history


@dataclass
class Session:
    sid: int
    kind: str
    start_step: int
    turns: list[Turn] = field(default_factory=list)


@dataclass(frozen=True)
class WorkloadParams:
    name: str
    seed: int
    n_chat: int
    n_agent: int
    n_burst: int
    arrival_window_steps: int  # sessions start uniformly in [0, window)
    n_system_prompts: int = 4
    chat_system_tokens: tuple[int, int] = (1024, 3072)
    agent_system_tokens: tuple[int, int] = (3072, 6144)
    chat_turns: tuple[int, int] = (2, 8)
    agent_turns: tuple[int, int] = (5, 16)
    chat_user_tokens: tuple[int, int] = (40, 400)
    agent_tool_tokens: tuple[int, int] = (150, 1500)
    chat_decode_median: int = 160
    agent_decode_median: int = 60
    burst_prompt_tokens: tuple[int, int] = (2048, 8192)
    burst_decode_median: int = 40
    burst_repeat_share: float = 0.25
    burst_size: int = 12
    chat_pause_steps: tuple[int, int] = (30, 400)
    agent_pause_steps: tuple[int, int] = (2, 40)
    burst_repeat_delay_steps: tuple[int, int] = (100, 800)
    max_context_tokens: int = 30000
    # Shapes from the independent check (issue 12). ``shape`` picks the generator:
    # "mix" (the chat/agent/burst mix above), "agentic" or "burst-repeat".
    shape: str = "mix"
    # agentic: n_agentic sessions, one shared system prompt, turns of new tokens.
    n_agentic: int = 0
    agentic_system_tokens: int = 2048
    agentic_turns: tuple[int, int] = (3, 7)
    agentic_new_tokens: tuple[int, int] = (128, 1024)
    agentic_decode_median: int = 60
    agentic_pause_steps: tuple[int, int] = (30, 400)
    # burst-repeat: n_unique prompts in bursts of burst_size, burst_gap_steps apart; a
    # share is re-sent after ``repeat_after_bursts`` to that many + 1 burst gaps, i.e.
    # after at least that many further bursts of unique traffic (each burst is larger
    # than the pool at the scale, so the pool turned over in between).
    n_unique: int = 0
    burst_gap_steps: int = 120
    repeat_share: float = 0.5
    repeat_after_bursts: int = 2

    def describe(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.__dict__.items())


def _toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def _lognormal_int(rng: random.Random, median: int, sigma: float = 0.6, lo: int = 4,
                   hi: int = 2048) -> int:
    return max(lo, min(hi, int(round(median * math.exp(rng.gauss(0.0, sigma))))))


def _generate_agentic(p: WorkloadParams) -> list[Session]:
    """Agentic (issue 12): every session shares one system prompt; 3-7 turns of
    128-1,024 new tokens (user/tool output), short decodes, 30-400 steps between turns."""
    rng = random.Random(p.seed)
    system = _toks(rng, p.agentic_system_tokens)
    sessions: list[Session] = []
    for sid in range(p.n_agentic):
        s = Session(sid, "agentic", rng.randrange(p.arrival_window_steps))
        used = len(system)
        for k in range(rng.randint(*p.agentic_turns)):
            n_new = rng.randint(*p.agentic_new_tokens)
            dec = _lognormal_int(rng, p.agentic_decode_median)
            if used + n_new + dec >= p.max_context_tokens:
                break
            used += n_new + dec
            new = (system if k == 0 else []) + _toks(rng, n_new)
            pause = 0 if k == 0 else rng.randint(*p.agentic_pause_steps)
            s.turns.append(Turn(new, dec, _toks(rng, dec), pause))
        sessions.append(s)
    sessions.sort(key=lambda x: (x.start_step, x.sid))
    return sessions


def _generate_burst_repeat(p: WorkloadParams) -> list[Session]:
    """Burst-repeat (issue 12): unique 2-8k-token prompts arriving in bursts (burst i
    at step i * burst_gap_steps, each request within 4 steps of it); ``repeat_share``
    of them (exactly, chosen at random) re-send the identical prompt after
    ``repeat_after_bursts``..+1 burst gaps of other traffic."""
    rng = random.Random(p.seed)
    n_rep = int(round(p.n_unique * p.repeat_share))
    repeats = set(rng.sample(range(p.n_unique), n_rep))
    sessions: list[Session] = []
    for i in range(p.n_unique):
        start = (i // p.burst_size) * p.burst_gap_steps + rng.randrange(4)
        s = Session(i, "burst", start)
        prompt = _toks(rng, rng.randint(*p.burst_prompt_tokens))
        dec = _lognormal_int(rng, p.burst_decode_median)
        s.turns.append(Turn(prompt, dec, _toks(rng, dec), 0))
        if i in repeats:
            dec2 = _lognormal_int(rng, p.burst_decode_median)
            lo = p.repeat_after_bursts * p.burst_gap_steps
            s.turns.append(Turn([], dec2, _toks(rng, dec2), rng.randint(lo, lo + p.burst_gap_steps),
                                repeat_whole_prompt=True))
        sessions.append(s)
    sessions.sort(key=lambda x: (x.start_step, x.sid))
    return sessions


def generate(p: WorkloadParams) -> list[Session]:
    if p.shape == "agentic":
        return _generate_agentic(p)
    if p.shape == "burst-repeat":
        return _generate_burst_repeat(p)
    rng = random.Random(p.seed)
    chat_sys = [_toks(rng, rng.randint(*p.chat_system_tokens)) for _ in range(p.n_system_prompts)]
    agent_sys = [_toks(rng, rng.randint(*p.agent_system_tokens))
                 for _ in range(max(1, p.n_system_prompts // 2))]
    sessions: list[Session] = []
    sid = 0

    def conversation(kind: str, systems: list[list[int]], turns: tuple[int, int],
                     later_tokens: tuple[int, int], decode_median: int,
                     pause_steps: tuple[int, int]) -> Session:
        """One session of ``kind``: a shared system prompt, then turns of new tokens
        (the first turn's drawn from ``chat_user_tokens``, the later ones' from
        ``later_tokens``), up to the first turn that would not fit the context."""
        s = Session(sid, kind, rng.randrange(p.arrival_window_steps))
        system = rng.choice(systems)
        used = len(system)
        for k in range(rng.randint(*turns)):
            n_new = rng.randint(*(p.chat_user_tokens if k == 0 else later_tokens))
            new = (system if k == 0 else []) + _toks(rng, n_new)
            dec = _lognormal_int(rng, decode_median)
            if used + n_new + dec >= p.max_context_tokens:
                break
            used += n_new + dec
            pause = 0 if k == 0 else rng.randint(*pause_steps)
            s.turns.append(Turn(new, dec, _toks(rng, dec), pause))
        return s

    for _ in range(p.n_chat):
        sessions.append(conversation("chat", chat_sys, p.chat_turns, p.chat_user_tokens,
                                     p.chat_decode_median, p.chat_pause_steps))
        sid += 1
    for _ in range(p.n_agent):
        sessions.append(conversation("agent", agent_sys, p.agent_turns, p.agent_tool_tokens,
                                     p.agent_decode_median, p.agent_pause_steps))
        sid += 1

    n_bursts = max(1, math.ceil(p.n_burst / p.burst_size))
    burst_starts = sorted(rng.randrange(p.arrival_window_steps) for _ in range(n_bursts))
    for i in range(p.n_burst):
        start = burst_starts[i // p.burst_size] + rng.randrange(4)
        s = Session(sid, "burst", start)
        sid += 1
        prompt = _toks(rng, rng.randint(*p.burst_prompt_tokens))
        dec = _lognormal_int(rng, p.burst_decode_median)
        s.turns.append(Turn(prompt, dec, _toks(rng, dec), 0))
        if rng.random() < p.burst_repeat_share:
            dec2 = _lognormal_int(rng, p.burst_decode_median)
            s.turns.append(Turn([], dec2, _toks(rng, dec2),
                                rng.randint(*p.burst_repeat_delay_steps),
                                repeat_whole_prompt=True))
        sessions.append(s)
    sessions.sort(key=lambda x: (x.start_step, x.sid))
    return sessions


def summarize(sessions: list[Session]) -> str:
    turns = sum(len(s.turns) for s in sessions)
    new_tokens = sum(len(t.new_tokens) for s in sessions for t in s.turns)
    dec = sum(t.decode_len for s in sessions for t in s.turns)
    kinds: dict[str, int] = {}
    for s in sessions:
        kinds[s.kind] = kinds.get(s.kind, 0) + 1
    return (f"sessions={len(sessions)} {kinds} requests={turns} new_prompt_tokens={new_tokens} "
            f"decode_tokens={dec}")


# Named presets. ``scale`` multiplies session counts; pools are chosen per preset.
PRESETS = {
    "multiturn": dict(n_chat=60, n_agent=30, n_burst=0),
    "burst": dict(n_chat=10, n_agent=0, n_burst=96),
    # issue 12 (independent check): scale multiplies n_agentic / n_unique / burst_size.
    "agentic": dict(shape="agentic", n_agentic=600),
    "burst-repeat": dict(shape="burst-repeat", n_unique=256, burst_size=64),
}


def make_params(preset: str, scale: float, seed: int, window: int) -> WorkloadParams:
    base = PRESETS[preset]
    if base.get("shape", "mix") != "mix":
        kw = dict(base)
        for k in ("n_agentic", "n_unique", "burst_size"):
            if k in kw:
                kw[k] = max(1, int(round(kw[k] * scale)))
        return WorkloadParams(name=preset, seed=seed, n_chat=0, n_agent=0, n_burst=0,
                              arrival_window_steps=window, **kw)
    return WorkloadParams(
        name=preset,
        seed=seed,
        n_chat=int(base["n_chat"] * scale),
        n_agent=int(base["n_agent"] * scale),
        n_burst=int(base["n_burst"] * scale),
        arrival_window_steps=window,
    )
