"""``python -P -m connector.recorder ENGINE_PID``: the recorder process
(``connector.recorder.process``), out of the engine's process tree first
(``connector.recorder.detach``), before anything heavy is imported, and at
the lowest priority before it starts a thread (``connector.background``)."""

import sys

from connector.background import yield_to_serving
from connector.recorder.detach import detach, report_exit

report = detach()
yield_to_serving()

from connector.recorder.process import main  # noqa: E402

code = 1
try:
    code = main()
finally:
    report_exit(report, code)
sys.exit(code)
