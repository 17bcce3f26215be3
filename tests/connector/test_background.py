"""The connector's background work, as the operating system sees it
(``connector.background``): its threads carry their names (the step's pass,
the hand-off's I/O thread), and the work nobody waits on (the hand-off's I/O
thread, the recorder process and all its threads) runs at the lowest priority,
while the thread that calls it and the step's pass keep theirs."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from connector.background import BACKGROUND_NICE, name_this_thread, yield_to_serving
from connector.handoff.link import IO_THREAD_NAME
from connector.handoff.sender import Handoff
from connector.shell.beside import PASS_THREAD_NAME, Beside
from tests.connector.test_handoff import FakeLink
from tests.connector.test_recorder_process import handoff as recorder_handoff

WAIT_S = 5.0


def _tasks(pid: str = "self") -> dict[int, tuple[str, int]]:
    """Each thread of ``pid``: its name and nice value, from ``/proc``."""
    tasks = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            nice = int((task / "stat").read_text().rsplit(")", 1)[1].split()[16])
        except OSError:
            continue  # gone meanwhile
        tasks[int(task.name)] = (name, nice)
    return tasks


def _in_thread(job: object) -> None:
    thread = threading.Thread(target=job)  # type: ignore[arg-type]
    thread.start()
    thread.join(WAIT_S)


def test_a_thread_named_shows_by_that_name_cut_to_fifteen_bytes() -> None:
    seen: dict[str, str] = {}

    def run() -> None:
        name_this_thread("a-name-longer-than-fifteen-bytes")
        seen["name"] = _tasks()[threading.get_native_id()][0]

    _in_thread(run)
    assert seen["name"] == "a-name-longer-t"


def test_a_thread_that_yields_is_lowered_and_its_caller_is_not() -> None:
    seen: dict[str, int] = {}
    before = _tasks()[threading.get_native_id()][1]

    def run() -> None:
        yield_to_serving()
        seen["own"] = _tasks()[threading.get_native_id()][1]
        child = threading.Thread(
            target=lambda: seen.setdefault("child", _tasks()[threading.get_native_id()][1]))
        child.start()
        child.join(WAIT_S)

    _in_thread(run)
    assert seen == {"own": BACKGROUND_NICE, "child": BACKGROUND_NICE}
    assert _tasks()[threading.get_native_id()][1] == before


def test_the_pass_thread_carries_its_name_and_keeps_its_priority() -> None:
    seen: list[tuple[str, int]] = []
    beside = Beside(threaded=True, failed=lambda name, error: None)
    beside.start(lambda: seen.append(_tasks()[threading.get_native_id()]))
    beside.settle()
    beside.close()
    assert seen == [(PASS_THREAD_NAME, _tasks()[threading.get_native_id()][1])]


def test_the_handoff_io_thread_carries_its_name_at_the_lowest_priority() -> None:
    link = FakeLink()
    handoff = Handoff(lambda: link, budget_bytes=1 << 20, warn=lambda m: None,
                      flush_every_s=3600.0, register_atexit=False)
    try:
        deadline = time.monotonic() + WAIT_S
        while ((IO_THREAD_NAME, BACKGROUND_NICE) not in _tasks().values()
               and time.monotonic() < deadline):
            time.sleep(0.01)
        assert (IO_THREAD_NAME, BACKGROUND_NICE) in _tasks().values()
    finally:
        handoff.close(None)


def test_every_thread_of_the_recorder_process_runs_at_the_lowest_priority(
        tmp_path: Path) -> None:
    handoff = recorder_handoff(tmp_path, [])
    try:
        deadline = time.monotonic() + 30.0
        while not handoff.recorder_up and time.monotonic() < deadline:
            handoff.io_turn()
            time.sleep(0.05)
        assert handoff.recorder_up
        pid = handoff._link.pid  # type: ignore[union-attr]
        threads = _tasks(str(pid))
        assert len(threads) > 1  # its writer's and ZeroMQ's threads too
        assert {nice for _, nice in threads.values()} == {BACKGROUND_NICE}, threads
    finally:
        handoff.close(None)
        assert handoff.wait_for_end()
