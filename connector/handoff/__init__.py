"""The engine's side of the event log: number, pack, hand off; nothing more.

vLLM's engine process pays for the log only here; everything else runs in
the recorder process (``connector.recorder``), which this side starts and
supervises.

Contract
--------
* On vLLM's scheduler thread, :class:`~connector.handoff.sender.Handoff`
  numbers each callback's applied events with the one cursor every writer
  of a log keeps (``offload_fsm.log.cursor``), packs them at once, and hands
  each batch over as one STEP message; it never blocks on the recorder and
  never raises because of the log.
* It is the one place that bounds and counts losses: what it holds for the
  log (unacknowledged bytes and their bookkeeping) never exceeds its byte
  budget; what does not fit, or comes while the recorder is dead or
  stalled, is dropped and counted (an *outage*), and the log records it as
  a GAP when the recorder is back (a START with the lost count and a
  snapshot).

Modules:

* :mod:`~connector.handoff.sender`: :class:`Handoff`, the budget and outages.
* :mod:`~connector.handoff.link`: what it holds towards one recorder (the
  link, the frames' bookkeeping, backoff, counters).
* :mod:`~connector.handoff.messages`: the protocol both processes speak.
* :mod:`~connector.handoff.supervisor`: starting a recorder and its socket.
"""
