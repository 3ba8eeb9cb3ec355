#!/usr/bin/env bash
# Set up .venv with torch and zinf (editable) on a fresh machine. Idempotent: re-running is quick.
# Where no NVIDIA GPU is present it installs the CPU build of torch (TORCH_SPEC overrides);
# where one is, it keeps an installed CUDA torch that satisfies the project's range.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
pip_() { "$VENV/bin/python" -m pip "$@"; }
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        pip_ install -q "${TORCH_SPEC:-torch>=2.4,<2.15}"
    else
        # On these machines torch==2.13.0 resolves to a CPU build on local disk in seconds;
        # a bare 'torch' would pull a multi-GB CUDA build.
        pip_ install -q "${TORCH_SPEC:-torch==2.13.0}"
    fi
fi
stamp="$VENV/.zinf-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    pip_ install -q -e ".[dev]"
    touch "$stamp"
fi
