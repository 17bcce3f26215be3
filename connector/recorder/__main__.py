"""``python -P -m connector.recorder ENGINE_PID``: the recorder process
(``connector.recorder.process``), out of the engine's process tree first
(``connector.recorder.detach``), before anything heavy is imported."""

import sys

from connector.recorder.detach import detach, report_exit

report = detach()

from connector.recorder.process import main  # noqa: E402

code = 1
try:
    code = main()
finally:
    report_exit(report, code)
sys.exit(code)
