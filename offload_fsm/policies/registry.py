"""Which hooks each drain policy runs (``scope.PolicyHooks``).

FIFO: ``fifo``. EVICTION_AWARE: ``eviction_aware`` (planning in
``ea_planner``, its state in ``blockindex`` and ``dedup``).
"""

from __future__ import annotations

from typing import Final

from offload_fsm.policies import eviction_aware, fifo
from offload_fsm.rules.scope import PolicyHooks
from offload_fsm.vocabulary.config import Policy

POLICY_HOOKS: Final[dict[Policy, PolicyHooks]] = {
    Policy.FIFO: fifo.HOOKS,
    Policy.EVICTION_AWARE: eviction_aware.HOOKS,
}


def hooks_for(policy: Policy) -> PolicyHooks:
    return POLICY_HOOKS[policy]
