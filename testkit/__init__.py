"""Test tooling shared by tests, demo and bench: the tiny random model builder
(``tiny_model``), the real LMCache server fixture (``lmcache_server``) and the test
environment (``env``).

A leaf: nothing of ours imports from here except ``tests``, ``demo`` and ``bench``, and
this package imports nothing of ours. It never imports ``tests``.
"""
