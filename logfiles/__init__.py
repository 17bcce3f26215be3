"""The event log's files on disk: which files make a run, and what they hold.

Contract: reads files and directories, never writes them; imports only the
standard library, attrs, :mod:`offload_fsm.log` (the pure codec: names,
framing, decoding, peeking) and the log's errors, so the recorder process
(``connector``) and every ``replay`` command share one definition of a run
and one scan, and neither needs the other. Nothing else lists or scans
``.lolog`` files.

* ``runs``: a run is every file of one prefix in one directory; its files in
  :func:`~offload_fsm.log.names.file_sort_key` order, a directory's prefixes,
  the run folders inside a folder, the number the next file of a run takes.
* ``scan``: THE loop over a file's frames, from its start or from a segment's
  offset: decoded records (:class:`~logfiles.scan.Entry`) and every damage
  (:class:`~logfiles.scan.LogDamage`), framing and decoding alike.
* ``segments``: where replay can start in a run (its snapshots, and the
  run's header at event 0) and the INDEX records it can trust, from one
  CRC-only pass.

The envelope peeks (a payload's kind, seq, a snapshot's digest) stay in the
pure ``offload_fsm.log.peek``; this package calls them.
"""
