"""The vLLM shell: the connector vLLM loads, on vLLM's scheduler thread.

Contract
--------
* :class:`~connector.shell.lmcache_connector.EventSourcedLMCacheMPConnector`
  is a drop-in for LMCache's ``LMCacheMPConnector`` (the same
  ``lmcache.mp.*`` keys, the same server). With lazy offload off it is
  LMCache's code unchanged; with it on, LMCache's lazy-offload manager is
  :class:`~connector.shell.manager.EventSourcedManager`, which turns each call
  into one event for ``offload_fsm`` and carries out the core's commands on
  vLLM's ``BlockPool``.
* No exception leaves a hook: a failure of the core or the shell switches to
  drain-only mode (pins released or kept until receipts, sessions still
  ended) and vLLM keeps serving.
* The applied events go to the event log through the engine's side of the
  hand-off (``connector.handoff``); the shell never writes a file.

Modules:

* ``lmcache_connector``: the connector class, its fail-fast checks, metrics
  and the lazy store-candidate path (``candidates``);
* ``manager``: the nine manager hooks; ``step_reading`` (a step as the core
  sees it), ``pool_commands`` (the core's commands on the pool),
  ``stores`` (LMCache's STORE metadata for what the core submits),
  ``blocks`` (the only module that touches vLLM's block objects);
* ``narrator``, ``logs``: the spec's log lines, structured; ``metrics``:
  vLLM's connector stats and Prometheus families;
* ``plugin``: the config checks at class resolution (vLLM's plugin entry
  point); ``shutdown_signal``: the SIGTERM hook of the shutdown flush;
  ``kv_events``: the warning when no LMCache-tier KV event reaches vLLM.
"""
