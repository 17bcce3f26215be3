"""The event log's format: how the core's inputs and outcomes are written
down so that ``replay`` can fold them again.

Contract: pure (no clock, no I/O, no logging; callers hand in bytes and
times); reads the vocabulary and the state, never the machine, so the shell
and the replay tool share one definition of every byte.

* ``framing``: records framed with a magic, length and CRC; a validating scan.
* ``records``: the record kinds, the schema version and its upcasters.
* ``wire``: events, decisions and commands as tuples; the packer; outcome checks.
* ``compact``: compact event forms (window deltas, hash references, runs).
* ``batch``: BATCH records, one zlib stream per segment.
* ``decode``: payload bytes back into records.
* ``peek``: an envelope's kind and body without decoding it.
* ``snapshot``, ``snapshot_tables``, ``snapshot_pack``: the whole state as
  plain data and back, packed compactly against the file's last snapshot.
* ``layout``: where records fall (batches, digest spacing), for every writer.
* ``names``: log file names and their order.
"""
