"""The connector's own threads carry their names to the operating system
(``connector.threadname``): the step's pass and the hand-off's I/O thread show
by name in ``top -H`` and ``/proc``, so their CPU is told apart from vLLM's."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from connector.handoff.link import IO_THREAD_NAME
from connector.handoff.sender import Handoff
from connector.shell.beside import PASS_THREAD_NAME, Beside
from connector.threadname import name_this_thread
from tests.connector.test_handoff import FakeLink

WAIT_S = 5.0


def _os_names() -> dict[int, str]:
    return {int(task.name): (task / "comm").read_text().strip()
            for task in Path("/proc/self/task").iterdir()}


def test_a_thread_named_shows_by_that_name_cut_to_fifteen_bytes() -> None:
    seen: dict[str, str] = {}

    def run() -> None:
        name_this_thread("a-name-longer-than-fifteen-bytes")
        seen["name"] = _os_names()[threading.get_native_id()]

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(WAIT_S)
    assert seen["name"] == "a-name-longer-t"


def test_the_pass_thread_carries_its_name() -> None:
    seen: list[str] = []
    beside = Beside(threaded=True, failed=lambda name, error: None)
    beside.start(lambda: seen.append(_os_names()[threading.get_native_id()]))
    beside.settle()
    beside.close()
    assert seen == [PASS_THREAD_NAME]


def test_the_handoff_io_thread_carries_its_name() -> None:
    link = FakeLink()
    handoff = Handoff(lambda: link, budget_bytes=1 << 20, warn=lambda m: None,
                      flush_every_s=3600.0, register_atexit=False)
    try:
        deadline = time.monotonic() + WAIT_S
        while IO_THREAD_NAME not in _os_names().values() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert IO_THREAD_NAME in _os_names().values()
    finally:
        handoff.close(None)
