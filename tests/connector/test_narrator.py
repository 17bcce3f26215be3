"""The narrator's lines: an abandoned or failed store says how many held-back
ops it cost, and the narrator keeps nothing from one outcome to the next."""

from __future__ import annotations

from typing import Any

import pytest

from connector.shell.narrator import Narrator
from offload_fsm.vocabulary.decisions import StoreAbandoned
from offload_fsm.vocabulary.outcome import Outcome
from tests.offload_fsm.test_lease import stored_early


class Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.lines.append((event, fields))

    info = warning


def test_an_abandoned_store_counts_its_held_back_ops_and_leaves_nothing_behind() -> None:
    h = stored_early(world_size=1)
    h.offer("r")  # buffered behind the batch in flight
    step = h.tick(dt_s=5.0)  # the lease runs out: abandoned, the held-back op dropped
    assert step.one(StoreAbandoned).req_id == "r"
    log = Log()
    narrator = Narrator(log, clock=lambda: 0.0)
    for _, outcome in step.applied:
        narrator.note(outcome)
    (line,) = [fields for event, fields in log.lines if "store abandoned" in event]
    assert line["held_back_ops_dropped"] == 1
    before = dict(vars(narrator))
    narrator.note(Outcome(decisions=tuple(reversed(
        [d for _, o in step.applied for d in o.decisions])), commands=()))
    (again,) = [f for e, f in log.lines[1:] if "store abandoned" in e]
    assert again["held_back_ops_dropped"] == 1  # either order of the decisions
    assert vars(narrator) == before  # nothing kept per request


def test_a_stale_warning_carries_the_run_and_the_request(
        caplog: pytest.LogCaptureFixture) -> None:
    """What ``replay explain`` needs is on the line: the run (the start-up
    line names its directory) and the request id."""
    from connector.shell.logs import LOGGER_NAME, get_logger
    from tests.offload_fsm.helpers import Harness, ea, shielded_then_cleared

    h = Harness(ea())
    shielded_then_cleared(h, "16-863188ed")
    narrator = Narrator(get_logger(), clock=lambda: 0.0, run="20261206T101500123Z-4242")
    with caplog.at_level("INFO", logger=LOGGER_NAME):
        for _, outcome in h.tick(allocated=4, next_blocks=4).applied:
            narrator.note(outcome)
    (line,) = [r.getMessage() for r in caplog.records if "stale store" in r.getMessage()]
    assert "req_id=16-863188ed" in line and "run=20261206T101500123Z-4242" in line


def test_a_reset_names_the_requests_it_cost_once(caplog: pytest.LogCaptureFixture) -> None:
    from connector.shell.logs import LOGGER_NAME, get_logger
    from tests.offload_fsm.helpers import Harness, ea

    h = Harness(ea())
    for req_id in ("a", "b"):
        h.arrive(req_id)
        h.offer(req_id)
        h.finish(req_id, free=1000)
    narrator = Narrator(get_logger(), clock=lambda: 0.0, run="R")
    with caplog.at_level("INFO", logger=LOGGER_NAME):
        for _, outcome in h.reset_cache().applied:
            narrator.note(outcome)
    (line,) = [r.getMessage() for r in caplog.records if "prefix cache was reset" in
               r.getMessage()]
    assert "run=R cache_reset_ops=2 req_ids=a,b" in line
