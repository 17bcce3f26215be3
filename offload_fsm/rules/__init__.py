"""The transitions every drain policy shares.

Contract: only ``machine.step`` calls in here, and these modules are the
only writers of the state besides it; they read the vocabulary and the state
and nothing above. Where the policies differ, they call the policy's hooks
through ``scope.Scope`` (``scope.PolicyHooks``), never a policy module.

* ``legality``: which event is legal when, which way an op may move (tables).
* ``lifecycle``: a request's arrival, offers, finish, preemption, cache
  reset and shutdown.
* ``buffer``: a request's buffered ops, drops, readiness and session end.
* ``drain``: steps, selection, verification (hashes re-read), submission and
  settlement (receipts, the receipt lease).
* ``pins``: the protections the core holds and the budget a drain leaves.
* ``split``: cutting an op at a chunk boundary.
* ``plan``: a planner's decision as data (what to select, what to hold).
* ``tail_flush``: the opt-in stores of the idle or shutting-down tail.
* ``scope``: one step's output and the policy seam.
"""
