"""Another revision of this repository, extracted to measure beside this one."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def extracted(rev: str, prefix: str) -> Iterator[Path]:
    """``git archive rev`` unpacked in a temporary directory, removed after."""
    tree = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        yield tree
    finally:
        shutil.rmtree(tree)
