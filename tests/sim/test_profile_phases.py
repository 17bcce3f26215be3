"""``bench.profile_steps`` times phases by wrapping named methods: each must
exist, so a module or method renamed fails here rather than in the middle of a
profile run."""

from __future__ import annotations

from testkit.env import require_stack

require_stack()

from bench.profile_steps import phases  # noqa: E402


def test_every_phase_names_a_callable_that_exists() -> None:
    missing = [f"{getattr(owner, '__name__', owner)}.{name}" for owner, name, _ in phases()
               if not callable(getattr(owner, name, None))]
    assert not missing, f"bench.profile_steps times what no longer exists: {missing}"
    names = [phase for _, _, phase in phases()]
    assert len(names) == len(set(names)), "two methods timed as one phase"
