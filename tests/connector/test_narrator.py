"""The narrator's lines: an abandoned or failed store says how many held-back
ops it cost, and the narrator keeps nothing from one outcome to the next."""

from __future__ import annotations

from typing import Any

from connector.narrator import Narrator
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
