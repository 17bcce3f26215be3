"""The drain policies: when a buffered store is submitted.

Contract: a policy is a ``rules.scope.PolicyHooks`` (``registry.hooks_for``);
the shared rules call it at fixed points and it plans drains with
``rules.drain.apply_plan``. Planners only read the state.

* ``fifo``: the spec's FIFO: after ``threshold`` finished requests, submit up
  to ``select_count`` of them, oldest first.
* ``eviction_aware`` (the default): submit a request's buffered ops when the
  GPU blocks holding them near vLLM's prefix-cache eviction head (the danger
  window), cascade when pins push the head, shield what a finish would
  expose; ``ea_planner`` plans it, ``blockindex`` maps blocks to the ops that
  cover them (and sees evictions), ``dedup`` stores each chunk's content once.
* ``registry``: which hooks each ``Policy`` runs.
"""
