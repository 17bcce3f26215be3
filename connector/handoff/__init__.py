"""The engine's side of the event log: number, pack, hand off; nothing more.

vLLM's engine process pays for the log only here. Everything else (the fold
that checks and snapshots, digests, compaction, compression, framing,
rotation, retention, the index, the live stream) runs in a recorder process
of its own (``connector.recorder``) that this side starts and supervises.

Contract towards the caller (vLLM's scheduler thread)
-----------------------------------------------------
* ``Handoff.record`` (``connector.handoff.sender``) takes what
  ``offload_fsm.drive`` returned and the state after it. It numbers the
  events (``seq`` from 0, no holes) with the one cursor every writer of a
  log keeps (``offload_fsm.log.cursor``) and packs each with its outcome's
  check (``log.wire.outcome_check``; the outcome's wire form with
  ``full_outcomes``) into msgpack bytes at once, so no event object outlives
  the callback. The callback that closes a batch sends the batch as one STEP
  message (``connector.handoff.messages``), which the recorder records as
  it came.
* It never blocks on the recorder and never raises because of the log: a
  failure of this code itself is an outage too (counted, one warning per
  kind of error), so the log can never stop offload.
  The scheduler thread appends each batch to the open *frame* and does no
  I/O for it. The hand-off's own I/O thread, every ``flush_every_s``
  (``sender.FLUSH_EVERY_S``, 100 ms), hands the open frame to ZeroMQ
  (``zmq.NOBLOCK`` over ``ipc://``: many steps as one message), reads the
  recorder's replies and watches its process (``Handoff.io_turn``), so the
  step pays no system call and no ZeroMQ wake-up for the log. Each turn
  wakes ZeroMQ's threads and the recorder's; a long period keeps those
  wake-ups few, because on a CPU engine each one takes a core from the
  model's threads. The scheduler thread hands a frame over itself only
  at ``sender.COALESCE_BYTES`` and at once for START, REJECT and END, and
  does what needs the engine's state: a dead recorder's restart and the
  START that ends an outage. An engine killed outright loses at most
  ``flush_every_s`` of events more. The two threads share one lock; the
  I/O thread takes it only when it is free and holds it for one turn
  (non-blocking calls only), which is all the scheduler thread can ever
  wait for.
* Bounded in bytes, bookkeeping included: what this side holds for the log
  (the messages' bytes not yet acknowledged by the recorder, wherever they
  are: the open frame, ZeroMQ's queues on either side, the socket between,
  plus ``link.FRAME_BYTES`` for each frame's bookkeeping here and in ZeroMQ,
  and an eighth of the open frame, its buffer's growth room) never exceeds
  ``budget_bytes``: one bookkeeping entry per frame, not per message, so
  however small the steps (37 bytes, an empty step) the count holds; the
  stats' ``bytes_in_flight`` is this count. The recorder acknowledges a
  frame once it has taken it in (handed its events to its writer's queue;
  it takes nothing more in while that queue is half full, so what waits for
  a slow disk waits here, within this budget: ``connector.recorder``). This
  is the one place that drops and counts events: a message that does not fit,
  or any message while the recorder is dead or stalled, is dropped and its
  events counted: an *outage*. One warning per outage (one per cause while
  the recorder keeps failing the same way), and the counters (``Handoff.stats``).
* When the recorder is back (acknowledging again, or restarted after it
  died, with backoff), the next batch boundary ends the outage: a START
  message with the number of events lost since the first one the recorder
  never acknowledged and a snapshot of the live state, from which the
  recorder restarts its fold; its log says GAP, then the snapshot.
* Backoff that holds: a recorder that dies, or cannot be started, is
  started again after ``backoff_s[0]``, doubling up to ``backoff_s[1]``; the
  delay returns to its minimum only once a recorder acknowledged its START
  (a recorder that dies on every START is not a storm). A recorder that
  reports why it could not start (a FAILED reply: the log directory cannot be
  written, a protocol version it does not speak) is warned about once per
  cause, with the fix, until one starts. RESYNCs are answered with the same
  doubling; a snapshot too large for the budget warns once, naming the
  setting and the size it needs, and is tried again with that doubling.
* ``Handoff.close`` hands END to the recorder and returns at once. On vLLM's
  way out (its scheduler's shutdown, ``Handoff.finish``; and at the
  interpreter's exit, :func:`atexit`, where there is one) the engine waits
  at most ``end_wait_s`` for the recorder to acknowledge END, so the END
  lands when vLLM stops normally within its 5 s grace.

Modules:

* :mod:`~connector.handoff.sender`: :class:`Handoff`, the budget and outages.
* :mod:`~connector.handoff.link`: what it holds towards one recorder (the
  link, the bytes in flight and their bookkeeping, backoff, counters).
* :mod:`~connector.handoff.messages`: the protocol both processes speak.
* :mod:`~connector.handoff.supervisor`: starting a recorder and its socket.
"""
