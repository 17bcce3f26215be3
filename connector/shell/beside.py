"""The step's pass beside the model: :class:`Beside` runs the scheduler step's
offload work (the core's step, its pins, hash reads and stores, the record)
on a thread of its own while vLLM's scheduler thread waits for the model.

Contract: one pass at a time. :meth:`Beside.start` hands the pass over and
returns at once; :meth:`Beside.settle` returns once no pass is running.
Whoever reads or changes what a pass touches settles first: every hook of
the manager (``connector.shell.manager``) and, through :func:`guard_pool`,
every ``BlockPool`` method vLLM calls while a pass is in flight, so vLLM
never sees the pool between two of the pass's changes and the pass never
sees it between two of vLLM's. Without the thread (``threaded=False``: tests,
benches that want one thread) a pass runs inside :meth:`start`.

Theory of operation
-------------------
vLLM's engine loop is ``schedule()``, the forward pass, then
``update_from_output()``. The scheduler thread is idle while the model
runs (it blocks on the workers' output, the GIL released), and nothing
touches the block pool then: ``schedule()`` has allocated, and
``update_from_output()`` frees only after it calls the connector
(``request_finished``). A pass started at the end of ``schedule()`` (once
``build_connector_meta`` is done) therefore reads the free queue and the blocks'
hashes as the next ``schedule()`` will first find them, and its pins land
before that ``schedule()`` allocates. Its time is the model's, not the
step's. The pass's stores go out with the next
step's connector metadata (one step later; their blocks stay pinned
meanwhile). Where vLLM overlaps steps (async scheduling) or the model is
quicker than the pass, the pool guard makes the next pool call wait for the
pass instead of racing it.

Failures: a pass's own failures are the manager's (``_guarded``, drain-only
mode); an exception that escapes it is reported to ``failed`` and the thread
goes on. Whatever ends the thread (``SystemExit``) still ends the pass, and
later passes run inline.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, Final

from connector.background import name_this_thread

__all__ = ["Beside", "guard_pool"]

PASS_THREAD_NAME: Final = "lazy-pass"  # the pass thread's name to the OS (top -H)
_JOIN_S: Final = 1.0  # how long close waits for the thread to end


class Beside:
    """See the module docstring. ``failed(name, error)`` hears of a pass
    that raised past the manager's own guard."""

    def __init__(self, *, threaded: bool, failed: Callable[[str, Exception], None]) -> None:
        self._failed = failed
        self._idle = threading.Event()
        self._idle.set()
        self._go = threading.Semaphore(0)
        self._job: Callable[[], None] | None = None
        self._thread: threading.Thread | None = None
        self._arm: Callable[[], None] | None = None
        self._disarm: Callable[[], None] | None = None
        self._armed = False
        if threaded:
            self._thread = threading.Thread(target=self._run, name="lazy-offload-pass",
                                            daemon=True)
            self._thread.start()

    @property
    def threaded(self) -> bool:
        """Whether passes run on the thread (it is alive)."""
        return self._thread is not None and self._thread.is_alive()

    def start(self, job: Callable[[], None]) -> None:
        """Run ``job`` as the next pass: on the thread, with the pool guard
        armed (:meth:`guard`), or now without one. Settles the last pass first."""
        self.settle()
        if not self.threaded:
            self._call(job)
            return
        if self._arm is not None:
            self._arm()
            self._armed = True
        self._idle.clear()
        self._job = job
        self._go.release()

    def guard(self, arm: Callable[[], None], disarm: Callable[[], None]) -> None:
        """``arm()`` before each pass on the thread, ``disarm()`` at the settle after it."""
        self._arm, self._disarm = arm, disarm

    def settle(self) -> None:
        """Return once no pass runs (the guard disarmed). On the pass's own
        thread, at once."""
        if (self._idle.is_set() and not self._armed) or self.in_pass():
            return
        self._idle.wait()
        if self._armed and self._disarm is not None:
            self._armed = False
            self._disarm()

    def in_pass(self) -> bool:
        """Whether the caller is the pass's thread."""
        thread = self._thread
        return thread is not None and threading.get_ident() == thread.ident

    def close(self) -> None:
        """Settle and stop the thread; later passes run inline."""
        self.settle()
        thread, self._thread = self._thread, None
        if thread is not None and thread.is_alive():
            self._job = None
            self._go.release()
            thread.join(timeout=_JOIN_S)

    def _run(self) -> None:
        name_this_thread(PASS_THREAD_NAME)
        while True:
            self._go.acquire()
            job, self._job = self._job, None
            if job is None:
                return
            try:
                self._call(job)
            finally:
                # Let the step go now: a job kept until the next one holds
                # vLLM's whole scheduler output a step longer.
                del job
                self._idle.set()

    def _call(self, job: Callable[[], None]) -> None:
        try:
            job()
        except Exception as error:  # the manager guards its own; this is the last net
            self._failed("scheduler step pass", error)


def guard_pool(pool: Any, beside: Beside) -> None:
    """Make every public method of ``pool`` settle ``beside`` before it runs
    while a pass is in flight (:meth:`Beside.guard`). Armed, each method is an
    instance attribute that settles and then calls what it covers (the
    pool's method, or the instance attribute already there, such as
    ``blocks.report_resets``' wrapper); the settle disarms them all, so
    between passes vLLM calls what it called before, at no cost. The pass's
    own calls go straight through. The wrappers are made once: arming and
    disarming allocate nothing."""
    names = [name for name in dir(type(pool))
             if not name.startswith("_") and callable(getattr(type(pool), name, None))]
    saved = {name: pool.__dict__[name] for name in names if name in pool.__dict__}

    def guarded(covered: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if not beside.in_pass():
                beside.settle()
            return covered(*args, **kwargs)
        return call

    wrappers = {name: guarded(saved.get(name) or getattr(pool, name)) for name in names}
    unsaved = [name for name in names if name not in saved]

    def disarm() -> None:
        pool.__dict__.update(saved)
        for name in unsaved:
            pool.__dict__.pop(name, None)

    beside.guard(functools.partial(pool.__dict__.update, wrappers), disarm)
