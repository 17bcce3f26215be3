"""Test support: a fake block pool and engine (``world``). Not imported by the
core package itself."""
