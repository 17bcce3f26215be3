#!/usr/bin/env bash
# The main job: set up the pinned CPU stack (idempotent), then run the demo on the embedded
# default (tiny local model, real LMCache server, our connector, small block pool).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/python -m demo "$@"
