"""``python -P -m connector.recorder``: the recorder process (``connector.recorder.process``)."""

import sys

from connector.recorder.process import main

sys.exit(main())
