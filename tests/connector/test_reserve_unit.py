"""The shell's next-step reserve (``StepScheduled.reserve_blocks``): a prefilling
request is charged another chunk only up to its prompt's end, and a request whose
prefill ends this step is charged like a decode. The pin budget keeps this reserve
free, so an overestimate holds drains back (what they would have stored is lost)
and an underestimate risks preemptions."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from testkit.env import require_stack

require_stack()

from connector.shell.step_reading import ReserveForecast, next_need  # noqa: E402

BLOCK = 16


def _output(new: list[tuple[str, int, int, int | None]],
            cached: list[tuple[str, int, int]]) -> Any:
    """``new``: (req id, computed, scheduled, prompt length); ``cached``: (req id,
    computed, scheduled)."""
    scheduled = {r: s for r, _, s, _ in new} | {r: s for r, _, s in cached}
    return SimpleNamespace(
        num_scheduled_tokens=scheduled,
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r, num_computed_tokens=c,
                            prompt_token_ids=None if p is None else list(range(p)))
            for r, c, _, p in new
        ],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _, _ in cached],
                                              num_computed_tokens=[c for _, c, _ in cached]),
    )


def _forecast() -> ReserveForecast:
    return ReserveForecast([BLOCK])


def test_a_prefill_is_charged_up_to_its_prompts_end_then_as_a_decode() -> None:
    forecast = _forecast()
    # 300-token prompt in chunks of 256: after the first chunk, 44 tokens (blocks 16-18) remain.
    assert forecast.blocks(_output([("a", 0, 256, 300)], [])) == 3
    assert forecast.prefilling == {"a": 300}
    # The second chunk ends the prompt at token 300 (mid-block): the first decode needs no block.
    assert forecast.blocks(_output([], [("a", 256, 44)])) == 0
    assert forecast.prefilling == {}  # nothing kept once the prefill is over


def test_a_prompt_prefilled_in_one_step_is_charged_like_a_decode() -> None:
    forecast = _forecast()
    assert forecast.blocks(_output([("a", 0, 4 * BLOCK, 4 * BLOCK),
                                        ("b", 0, 100, 100)], [])) == 1  # a's decode opens block 4
    assert forecast.prefilling == {}


def test_an_unknown_prompt_continues_with_a_chunk_like_this_one() -> None:
    forecast = _forecast()
    # No prompt token ids (prompt embeddings), and a cached request never seen new.
    assert forecast.blocks(_output([("a", 0, 100, None)], [("b", 32, 64)])) == 7 + 4
    assert forecast.prefilling == {}


def test_a_request_not_scheduled_for_a_step_is_forgotten() -> None:
    forecast = _forecast()
    forecast.blocks(_output([("a", 0, 256, 1000)], []))
    forecast.blocks(_output([], []))  # "a" skipped a step (budget, preemption)
    # Back, still prefilling: its prompt length is no longer known, so it is charged a chunk.
    assert forecast.blocks(_output([], [("a", 256, 256)])) == 16


def test_next_need_counts_the_blocks_the_next_tokens_open() -> None:
    keep: dict[str, int] = {}
    # 20 tokens done (blocks 0-1 allocated); a chunk like this one reaches token 40: block 2.
    assert next_need("r", 0, 20, 44, BLOCK, keep) == 1 and keep == {"r": 44}
    assert next_need("d", 31, 1, None, BLOCK, {}) == 1  # a decode that fills block 1
    assert next_need("d", 30, 1, None, BLOCK, {}) == 0
