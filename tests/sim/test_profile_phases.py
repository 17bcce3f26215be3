"""``bench.profile_steps`` times phases by wrapping named methods: each must
exist, so a module or method renamed fails here rather than in the middle of a
profile run."""

from __future__ import annotations

import gc

import pytest

from testkit.env import require_stack

require_stack()

from bench.profile_steps import phases  # noqa: E402


def test_every_phase_names_a_callable_that_exists() -> None:
    missing = [f"{getattr(owner, '__name__', owner)}.{name}" for owner, name, _ in phases()
               if not callable(getattr(owner, name, None))]
    assert not missing, f"bench.profile_steps times what no longer exists: {missing}"
    names = [phase for _, _, phase in phases()]
    assert len(names) == len(set(names)), "two methods timed as one phase"


def test_a_wrapped_phase_reports_the_objects_it_left_allocated(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A phase that keeps 50 GC-tracked objects a call shows about 50,000 per
    1,000 whole steps in the allocation table (a free of the interpreter's
    may land in it); the whole step is its own row
    and no phase shares its name."""
    from bench import profile_steps

    kept: list[list[int]] = []

    class Owner:
        @staticmethod
        def keep() -> None:
            for i in range(50):
                kept.append([i])

    saved = dict(profile_steps._NET), profile_steps._SERVING[0]
    profile_steps._NET.clear()
    profile_steps._SERVING[0] = ("arm", 0)
    gc.disable()  # no collection between a call's two counts (the profile leaves those out)
    try:
        profile_steps._wrap(Owner, "keep", "keeping")
        for _ in range(3):  # the interpreter's own first-call frees
            Owner.keep()
        profile_steps._NET.clear()
        for _ in range(4):
            Owner.keep()
            profile_steps._net(profile_steps.WHOLE_STEP, 0)
        profile_steps._report_net()
    finally:
        gc.enable()
        profile_steps._NET.clear()
        profile_steps._NET.update(saved[0])
        profile_steps._SERVING[0] = saved[1]
    rows = {line.split("   (")[0].rsplit(maxsplit=1)[0].strip():
            line.split("   (")[0].rsplit(maxsplit=1)[1]
            for line in capsys.readouterr().out.splitlines() if "calls)" in line}
    assert set(rows) == {"keeping", profile_steps.WHOLE_STEP}, rows
    assert 45_000 <= int(rows["keeping"]) <= 50_000 and rows[profile_steps.WHOLE_STEP] == "0"
    assert profile_steps.WHOLE_STEP not in {phase for _, _, phase in phases()}


def test_a_phase_timed_on_another_thread_is_filed_beside() -> None:
    """The step's pass runs on its own thread: its phases must not read as the
    scheduler thread's (the step pays only the scheduler thread's)."""
    import threading

    from bench import profile_steps

    class Owner:
        @staticmethod
        def work() -> None:
            pass

    profile_steps._wrap(Owner, "work", "working")
    profile_steps._PHASES.clear()
    try:
        Owner.work()
        thread = threading.Thread(target=Owner.work)
        thread.start()
        thread.join()
        assert set(profile_steps._PHASES) == {"working", "working (beside)"}
    finally:
        profile_steps._PHASES.clear()


def test_every_vllm_call_the_step_split_times_exists() -> None:
    from bench.step_split import CALLS, _owners

    owners = _owners()
    missing = [f"{owner}.{name}" for owner, names in CALLS.items() for name in names
               if not callable(getattr(owners[owner], name, None))]
    assert not missing, f"bench.step_split times what vLLM no longer has: {missing}"


def test_the_step_split_reports_each_arm_against_the_first(
        capsys: pytest.CaptureFixture[str]) -> None:
    from bench.step_split import report

    eager = [(1.0, 0.2, {"Scheduler.schedule": 0.0007}, 0)] * 201
    ours = [(1.2, 0.25, {"Scheduler.schedule": 0.0008}, 50)] * 100 + \
        [(1.5, 0.25, {"Scheduler.schedule": 0.0008}, 2000)] * 101
    report({"stock eager": eager, "ours EA": ours})
    rows = {cells[0]: cells[1:] for cells in (
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in capsys.readouterr().out.splitlines() if line.startswith("| "))}
    assert rows["step"] == ["1.000", "1.350", "+0.350"]  # 100 around the median: half each
    assert rows["rest"] == ["0.800", "1.100", "+0.300"]
    assert rows["Scheduler.schedule"] == ["0.700", "0.800", "+0.100"]
    assert rows["0-99"] == ["100", "+0.200", "+0.050", "+0.150"]  # step for step, by backlog
    assert rows["1000-"] == ["101", "+0.500", "+0.050", "+0.450"]
    assert "100-999" not in rows
