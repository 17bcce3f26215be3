"""replay: the operator's tool for recorded lazy-offload event logs (verify,
explain, summary, whatif, timeline, tail). Imports ``offload_fsm``, never
``connector``. Run ``python -m replay --help``."""
