"""What one ``step`` returns: the decisions it made and the commands the
shell must execute, in order."""

from __future__ import annotations

from typing import Final

import attrs

from offload_fsm.vocabulary.commands import Command
from offload_fsm.vocabulary.decisions import Decision


@attrs.frozen(kw_only=True)
class Outcome:
    decisions: tuple[Decision, ...]
    commands: tuple[Command, ...]


NO_OUTCOME: Final = Outcome(decisions=(), commands=())  # frozen, so one instance serves all
