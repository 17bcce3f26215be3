"""vLLM's log points at the event log: the start-up line names the directory,
this run's file prefix, and the ``replay explain`` command that takes a
warning's ``req_id=``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from testkit.env import require_stack

require_stack()

from offload_fsm.vocabulary.config import Settings, ShellConfig  # noqa: E402


def test_the_start_up_line_names_the_directory_and_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    import connector.shell.lmcache_connector as module

    def launcher(spec: dict[str, Any]) -> Any:
        def launch() -> Any:
            raise OSError("not started in this test")
        return launch

    monkeypatch.setattr(module, "launcher", launcher)
    directory = tmp_path / "logs"
    settings = Settings(shell=ShellConfig(enabled=True, log_dir=str(directory)))
    with caplog.at_level("INFO", logger="vllm.lazy_offload"):
        assert module._make_handoff(settings, 1, prefix="20261206T101500123Z-4242") is not None
    (line,) = [r.getMessage() for r in caplog.records if "event log in" in r.getMessage()]
    assert f"event log in {directory}, this run's files 20261206T101500123Z-4242-*.lolog" \
        in line
    assert (f"python -m replay explain {directory} --prefix 20261206T101500123Z-4242 "
            "--request ID") in line
