"""The core stays a house a newcomer can live in: no module of ``offload_fsm``
(its ``testing/`` aside) grows past 400 lines; split it along its seams."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "offload_fsm"
MAX_LINES = 400


def test_no_core_module_is_over_400_lines() -> None:
    sizes = {p.name: len(p.read_text().splitlines()) for p in PACKAGE.glob("*.py")}
    assert sizes, "no core modules found"
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}
