"""The core stays a house a newcomer can live in.

* No module of ``offload_fsm`` (at any depth; its ``testing/`` aside) grows
  past 400 lines: split it along its seams.
* The module map (``docs/architecture.md``) names every module of the core,
  so a newcomer who reads it has seen every room.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "offload_fsm"
MAX_LINES = 400


def _modules() -> list[Path]:
    return sorted(path for path in PACKAGE.rglob("*.py")
                  if "testing" not in path.relative_to(PACKAGE).parts)


def test_no_core_module_is_over_400_lines() -> None:
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in _modules()}
    assert len(sizes) > 40, "the walk found too few core modules"
    assert {name: n for name, n in sizes.items() if n > MAX_LINES} == {}


def _module_map() -> str:
    readme = (REPO / "docs" / "architecture.md").read_text()
    start = readme.index("The core is four layer packages")
    end = readme.index("```\n\n", readme.index("```", start) + 3)
    return readme[start:end]


def test_the_module_map_names_every_core_module() -> None:
    names = set(re.findall(r"^ *([A-Za-z_]\w*\.py|[A-Za-z_]\w*/)", _module_map(), re.M))
    expected = {p.name for p in _modules() if p.name != "__init__.py"}
    expected |= {f"{p.name}/" for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    assert expected - names == set()
    assert names - expected == set(), "the map names modules that do not exist"
