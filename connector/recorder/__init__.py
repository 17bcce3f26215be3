"""The recorder process: everything the event log needs, away from vLLM's process.

One per engine, started by the engine's hand-off (``connector.handoff``) as
``python -P -m connector.recorder`` (:mod:`connector.recorder.__main__`).

Contract
--------
* It records what the engine hands over, as it was handed over: each STEP
  (one batch, numbered by the engine) becomes one INPUTS record; a START
  resumes the log (a GAP for what the engine says it lost, then a
  snapshot); END ends it. It folds the events into a state of its own to
  check them against the engine's outcomes and to take digests and
  snapshots, and asks the engine for a snapshot (RESYNC) when the two
  disagree. It never decides a loss: the engine's hand-off is the one
  place that bounds what is in flight and counts what it dropped.
* It bounds what it holds by taking nothing more from its socket while
  its writer's queue is half full (what waits stays in the engine's
  budget), and its writer drops and counts events only while the disk
  fails or stalls (a GAP when it resumes).
* It is not in the engine's process tree (:mod:`~connector.recorder.detach`:
  vLLM SIGKILLs that tree when it gives up on an engine core), and it never
  outlives its engine: the engine gone without END, it records what is
  still in its socket, ends the log with VANISHED and exits.

Modules, in the order an event goes through them:

* :mod:`~connector.recorder.process`: the loop, the messages, the fold.
* :mod:`~connector.recorder.recording`: :class:`EventRecorder`, the
  cursor (``offload_fsm.log.cursor``), digests, snapshots, rotation.
* :mod:`~connector.recorder.encoder`: items into payloads (compact forms,
  segments, indexes, headers), on the writer thread.
* :mod:`~connector.recorder.stream`: the live stream (ZeroMQ PUB).
* :mod:`~connector.recorder.writer`: the writer, the producer's half (the
  queue, rotation requests, close, counters), and
  :mod:`~connector.recorder.writer_thread`, its thread's half (batches,
  placing records, rotation, a failing or stalled disk).
* :mod:`~connector.recorder.files`: one run's files (open, write, sync, probe).
* :mod:`~connector.recorder.retention`: the directory's bound across
  writers (locks, deletion).
* :mod:`~connector.recorder.ondisk`: where a run's files end.
"""
