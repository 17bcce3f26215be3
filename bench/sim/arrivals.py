"""The workload's side of a run: when each session's next turn arrives, and what it sends.

Contract: :class:`Arrivals` holds where every session of a generated workload
(``bench.sim.workload``) is. :meth:`Arrivals.pop_due` yields every turn released
by a step, with its request id (``s<session>t<turn>``) and prompt; the loop
reports each turn's request as started and, once vLLM finished it, as finished;
:attr:`Arrivals.done` says when every session has run its last turn.

Theory of operation: the loop is closed, so every arm sees the same content and
the same relative timing whatever its speed: a session's first turn is released
at its ``start_step``, and turn ``k + 1`` ``pause_steps`` (at least one) after
turn ``k`` finished. A turn's prompt is the conversation so far (the previous
turn's prompt and its output, as vLLM produced it) plus the turn's new tokens,
or turn 0's new tokens alone for a burst repeat, which does not extend the
conversation either.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from bench.sim.workload import Session, Turn


@dataclass
class Arrivals:
    by_sid: dict[int, Session]
    next_turn: dict[int, int]
    release: list[tuple[int, int]]  # heap of (release step, sid)
    live_sessions: int
    conv: dict[int, list[int]] = field(default_factory=dict)
    active: dict[str, tuple[Any, int]] = field(default_factory=dict)  # rid -> (Request, sid)
    out_tokens: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def start(cls, sessions: list[Session]) -> Arrivals:
        release = [(s.start_step, s.sid) for s in sessions]
        heapq.heapify(release)
        return cls(by_sid={s.sid: s for s in sessions},
                   next_turn={s.sid: 0 for s in sessions}, release=release,
                   live_sessions=len(sessions))

    @property
    def done(self) -> bool:
        return self.live_sessions == 0 and not self.active

    def pop_due(self, step: int) -> Iterator[tuple[str, list[int], Turn, int]]:
        """``(rid, prompt, turn, sid)`` of every turn released by ``step``."""
        while self.release and self.release[0][0] <= step:
            _, sid = heapq.heappop(self.release)
            s = self.by_sid[sid]
            k = self.next_turn[sid]
            turn = s.turns[k]
            if turn.repeat_whole_prompt:
                prompt = list(s.turns[0].new_tokens)
            else:
                prompt = self.conv.get(sid, []) + turn.new_tokens
            yield f"s{sid}t{k}", prompt, turn, sid

    def started(self, rid: str, req: Any, sid: int, turn: Turn) -> None:
        self.out_tokens[rid] = turn.out_tokens
        self.active[rid] = (req, sid)

    def finished(self, rid: str, step: int) -> None:
        """Turn ``rid`` finished at ``step``: schedule its session's next turn."""
        req, sid = self.active.pop(rid)
        s = self.by_sid[sid]
        k = self.next_turn[sid]
        turn = s.turns[k]
        if not turn.repeat_whole_prompt:
            self.conv[sid] = list(req.prompt_token_ids) + list(req.output_token_ids)
        self.next_turn[sid] = k + 1
        if k + 1 < len(s.turns):
            heapq.heappush(self.release, (step + max(1, s.turns[k + 1].pause_steps), sid))
        else:
            self.live_sessions -= 1
