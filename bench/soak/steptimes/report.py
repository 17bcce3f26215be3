"""Print what ``bench/soak/steptimes/sitecustomize.py`` wrote: per process (in the
order they started), per part, the calls, the total and the mean per call.

    PY -m bench.soak.steptimes.report STEPTIME_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(directory: str) -> None:
    for path in sorted(Path(directory).glob("*.json"), key=lambda p: p.stat().st_mtime):
        parts = json.loads(path.read_text())["parts"]
        print(f"pid {path.stem}")
        for part, (calls, seconds) in sorted(parts.items(), key=lambda kv: -kv[1][1]):
            print(f"  {part:40s} {int(calls):8d} calls {seconds:9.3f} s "
                  f"{seconds / max(calls, 1) * 1e6:9.1f} us a call")


if __name__ == "__main__":
    main(sys.argv[1])
