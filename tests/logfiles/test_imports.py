"""The package keeps its place: of ours it imports only the log codec and
the log's errors, and neither the connector nor replay."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "logfiles"
ALLOWED = ("logfiles", "offload_fsm.log", "offload_fsm.vocabulary.errors")
OURS = ("offload_fsm", "connector", "replay", "testkit", "tests", "bench", "demo")


def _ours_imported(source: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(source)):
        names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module and
                 node.level == 0 else
                 [alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
        found.update(name for name in names if name.split(".")[0] in (*OURS, "logfiles"))
    return found


def _offending(source: str) -> set[str]:
    return {name for name in _ours_imported(source)
            if not any(name == allowed or name.startswith(allowed + ".")
                       for allowed in ALLOWED)}


def test_logfiles_imports_only_the_log_codec_of_ours() -> None:
    sources = sorted(PACKAGE.glob("*.py"))
    assert len(sources) >= 4
    assert {str(path.name): _offending(path.read_text()) for path in sources} == {
        str(path.name): set() for path in sources}


def test_the_rule_sees_a_forbidden_import() -> None:
    assert _offending("def f():\n    from replay.runner import replay\n") == {"replay.runner"}
    assert _offending("import connector.recorder\nfrom offload_fsm.log.names import x\n") == {
        "connector.recorder"}
    assert _offending("from offload_fsm.state import State\n") == {"offload_fsm.state"}
