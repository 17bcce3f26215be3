"""The core's words: what goes in, what comes out, and the settings.

Contract: every module here is a leaf of the core (it imports nothing of
``offload_fsm`` outside this package) and holds only frozen, keyword-only
records, enums and tables; no rule of the machine lives here.

* ``events``: facts the connector observed (past tense), the core's only input.
* ``commands``: orders for the shell (verb + noun), executed in order.
* ``decisions``: what the core chose and why, for the log and ``replay explain``.
* ``outcome``: what one ``step`` returns (decisions and commands).
* ``errors``: the one poison path's errors and the log's.
* ``config``: every ``lmcache.mp.lazy_offload*`` key parsed in one place; the
  core's record (``OffloadConfig``) and the connector's (``ShellConfig``).
* ``counters``: the ledger's and the drains' named counters, in wire order.

Wire tags (events 1-99, decisions 100-199, commands 200-299) are never
renumbered: recorded logs name messages by them.
"""
