"""Test tooling shared by tests, demo and bench: the tiny random model builder
(``tiny_model``), the real LMCache server fixture (``lmcache_server``), vLLM's OpenAI
API server as a process (``api_server``) and the test environment (``env``).

Nothing of ours imports from here except ``tests``, ``demo`` and ``bench``. It imports
the core and ``replay`` only where it re-records kept logs (``rerecord``) and edits
them (``logedit``), and it never imports ``tests``.
"""
