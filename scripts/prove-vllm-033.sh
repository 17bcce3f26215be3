#!/usr/bin/env bash
# Scheduler-level proof on the GPU deployment's vLLM (vllm==0.33.0, pyproject extra `gpu`),
# run on these CPUs.  NOT part of CI: the venv is about 10 GB and the install takes 10+ min.
#
# Idempotently builds ./.venv-vllm033 (python3.11 -m venv) with vllm==0.33.0, lmcache==0.5.6
# and the project's runtime/test deps, removes torchvision/torchaudio/torchcodec when they
# break transformers imports (as scripts/setup.sh does), installs this project editable
# (--no-deps), and then, with VLLM_TARGET_DEVICE=cpu and PYTHONHASHSEED=0:
#   1. python -m bench.simulate --scale small --configs 0 \
#          --arms "stock eager,stock EA,ours EA,ours FIFO 20/10"
#      (both arms drive vLLM 0.33's real scheduler; compare with the same command on .venv)
#   2. python -m pytest -q tests/connector tests/sim tests/offload_fsm tests/replay
#      (scheduler-side connector tests that need no model run)
# pip may resolve a CUDA torch build; that is fine for importing the scheduler on CPU.
# Exit status: non-zero if the install, the simulator or any test fails.
# Usage: bash scripts/prove-vllm-033.sh            (PROVE_SKIP_TESTS=1 skips step 2)
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${REPO_ROOT}/.venv-vllm033"
PY_BOOTSTRAP="${PYTHON:-python3.11}"
VLLM_VERSION="0.33.0"
LMCACHE_VERSION="0.5.6"
TOOL_PKGS=(attrs msgpack structlog pyzmq pytest hypothesis)
CUDA_ONLY_PKGS=(torchvision torchaudio torchcodec)
ARMS="stock eager,stock EA,ours EA,ours FIFO 20/10"

log() { printf '[prove-vllm-033] %s\n' "$*"; }

cd "${REPO_ROOT}"

if [[ ! -x "${VENV}/bin/python" ]]; then
    log "creating virtualenv ${VENV} with ${PY_BOOTSTRAP}"
    "${PY_BOOTSTRAP}" -m venv "${VENV}"
fi
PY="${VENV}/bin/python"
PIP=("${PY}" -m pip)

have_stack() {
    "${PY}" - "${VLLM_VERSION}" "${LMCACHE_VERSION}" "${TOOL_PKGS[@]}" <<'PYEOF' 2>/dev/null
import sys
from importlib.metadata import PackageNotFoundError, version
try:
    ok = version("vllm") == sys.argv[1] and version("lmcache") == sys.argv[2]
    ok = ok and all(version(t) for t in sys.argv[3:])
except PackageNotFoundError:
    ok = False
sys.exit(0 if ok else 1)
PYEOF
}

if have_stack; then
    log "vllm ${VLLM_VERSION} + lmcache ${LMCACHE_VERSION} already installed; skipping heavy install"
else
    log "installing vllm==${VLLM_VERSION} lmcache==${LMCACHE_VERSION} ${TOOL_PKGS[*]} (10+ min, ~10 GB)"
    "${PIP[@]}" install --progress-bar off "vllm==${VLLM_VERSION}" \
        "lmcache==${LMCACHE_VERSION}" "${TOOL_PKGS[@]}"
fi

# Remove the CUDA-only media wheels only if transformers cannot be imported with them.
if ! "${PY}" -c "import transformers, transformers.models.auto" >/dev/null 2>&1; then
    present=()
    for pkg in "${CUDA_ONLY_PKGS[@]}"; do
        if "${PIP[@]}" show -q "${pkg}" >/dev/null 2>&1; then present+=("${pkg}"); fi
    done
    if ((${#present[@]})); then
        log "transformers import fails; removing ${present[*]}"
        "${PIP[@]}" uninstall -q -y "${present[@]}"
    fi
fi

log "installing project in editable mode (no deps)"
"${PIP[@]}" install -q -e . --no-deps

export VLLM_TARGET_DEVICE=cpu
export PYTHONHASHSEED=0

"${PY}" - <<'PYEOF'
from importlib.metadata import version
import torch
import vllm
print(f"[prove-vllm-033] vllm {vllm.__version__} (dist {version('vllm')}), "
      f"lmcache {version('lmcache')}, torch {torch.__version__}, "
      f"VLLM_TARGET_DEVICE=cpu")
PYEOF

log "1/2 simulator: python -m bench.simulate --scale small --configs 0 --arms \"${ARMS}\""
"${PY}" -m bench.simulate --scale small --configs 0 --arms "${ARMS}"

if [[ "${PROVE_SKIP_TESTS:-0}" == 1 ]]; then
    log "PROVE_SKIP_TESTS=1: skipping scheduler-side tests"
    exit 0
fi
log "2/2 tests: python -m pytest -q tests/connector tests/sim tests/offload_fsm tests/replay"
"${PY}" -m pytest -q -p no:cacheprovider tests/connector tests/sim tests/offload_fsm tests/replay
log "done: vLLM ${VLLM_VERSION} scheduler-level runs passed"
