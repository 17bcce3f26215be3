"""One file with what every engine process of a test session logged, so a failing
end-to-end test can quote how the engine shut down (vLLM's engine core and workers
are spawned: their log lines never reach pytest's capture of the test process).

Primitives:
  route_engine_logs(path)  vLLM's log config for the processes spawned from now on:
                           its usual console handler plus ``path``; the test process's
                           own ``vllm`` logger gets the same file
  note(line)               append one line of the test's own (an engine's exit codes)
  engine_log_tail(n)       the last ``n`` lines that tell a shutdown's story

Contract: a ``VLLM_LOGGING_CONFIG_PATH`` already in the environment wins (nothing is
routed); :func:`note` and :func:`engine_log_tail` are no-ops then.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

ENV = "E2E_ENGINE_LOG"
_STORY = re.compile(r"\[shutdown\]|lazy offload|Lazy offload|event log|Traceback|Error|"
                    r"exit codes|killed|still running")
_FORMAT = ("(%(vllm_process_name)s pid=%(process)d) %(levelname)s %(asctime)s "
           "[%(fileinfo)s:%(lineno)d] %(message)s")


def route_engine_logs(path: Path) -> None:
    if "VLLM_LOGGING_CONFIG_PATH" in os.environ:
        return
    formatter = {"()": "vllm.logging_utils.NewLineFormatter", "format": _FORMAT,
                 "datefmt": "%m-%d %H:%M:%S"}
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"vllm": formatter},
        "handlers": {
            "console": {"class": "logging.StreamHandler", "formatter": "vllm",
                        "level": "INFO", "stream": "ext://sys.stdout"},
            "file": {"class": "logging.FileHandler", "formatter": "vllm", "level": "INFO",
                     "filename": str(path), "mode": "a"},
        },
        "loggers": {"vllm": {"handlers": ["console", "file"], "level": "INFO",
                             "propagate": False}},
    }
    config_path = path.with_suffix(".json")
    config_path.write_text(json.dumps(config))
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(config_path)
    os.environ[ENV] = str(path)
    handler = logging.FileHandler(path, mode="a")
    handler.setFormatter(logging.Formatter("(test pid=%(process)d) %(levelname)s "
                                           "%(asctime)s %(message)s", "%m-%d %H:%M:%S"))
    logging.getLogger("vllm").addHandler(handler)


def note(line: str) -> None:
    path = os.environ.get(ENV)
    if path:
        with open(path, "a") as f:
            f.write(f"(test pid={os.getpid()}) {line}\n")


def engine_log_tail(lines: int = 30) -> str:
    path = os.environ.get(ENV)
    if not path or not Path(path).exists():
        return "(no engine log)"
    story = [line.rstrip()[:300] for line in Path(path).read_text(errors="replace")
             .splitlines() if _STORY.search(line)]
    return "\n".join(story[-lines:])
