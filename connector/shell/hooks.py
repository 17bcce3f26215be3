"""The contract of every method vLLM (or LMCache for it) calls on the
lazy-offload manager (``connector.shell.manager``): :func:`hook`.

Such a method settles the step's pass first (``connector.shell.beside``: the
pass may still hold the core's state and the pool), and nothing it raises
reaches vLLM: the error is reported once per method (``hook_failed``) and the
method's ``default()`` is returned. The core's own failures never get this
far (the manager turns them into drain-only mode); this catches the shell's
and the drain's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

__all__ = ["Hooked", "hook"]

_R = TypeVar("_R")


class Hooked(Protocol):
    """What :func:`hook` needs of the object whose methods it wraps."""

    def settle(self) -> None: ...

    def hook_failed(self, name: str, error: Exception) -> None: ...


def hook(default: Callable[[], Any], *, settle: bool = True
         ) -> Callable[[Callable[..., _R]], Callable[..., _R]]:
    """See the module docstring; ``settle=False`` for a method that runs
    inside a signal handler (it may interrupt a settle) and reads nothing
    the pass writes."""

    def wrap(method: Callable[..., _R]) -> Callable[..., _R]:
        @functools.wraps(method)
        def call(self: Hooked, *args: Any, **kwargs: Any) -> _R:
            try:
                if settle:
                    self.settle()
                return method(self, *args, **kwargs)
            except Exception as error:
                self.hook_failed(method.__name__, error)
                return default()  # type: ignore[no-any-return]
        return call

    return wrap
