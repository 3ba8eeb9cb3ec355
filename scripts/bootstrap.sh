#!/usr/bin/env bash
# Set up .venv with torch and zinf (editable) on a fresh machine. Idempotent: re-running is quick.
# Where no NVIDIA GPU is present it installs the CPU build of torch (TORCH_SPEC overrides);
# where one is, it keeps an installed CUDA torch that satisfies the project's range.
# The browser tests (tests/test_browser.py) drive Debian's chromium through playwright: it is
# installed here with apt when /usr/bin/chromium is missing (playwright's own browser download
# does not work on these machines, and is never used).
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
    pip_ install -q -e ".[dev]"  # the dev extra brings pytest, playwright (the Python side only) and pillow
    touch "$stamp"
fi

# Debian's chromium, for the browser tests. Should it fail to install, setup goes on and those
# tests fail, saying how to install it.
install_chromium() {
    local as_root=()
    if [ "$(id -u)" -ne 0 ]; then
        if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
            as_root=(sudo -n)
        else
            echo "bootstrap: not root and no sudo: cannot install chromium" >&2
            return 1
        fi
    fi
    echo "bootstrap: /usr/bin/chromium is missing; installing Debian's chromium (and a font for its" \
         "screenshots): ${as_root[*]:+${as_root[*]} }apt-get install -y --no-install-recommends chromium fonts-liberation"
    export DEBIAN_FRONTEND=noninteractive
    "${as_root[@]}" apt-get install -y -q --no-install-recommends chromium fonts-liberation && return 0
    echo "bootstrap: that failed; running apt-get update, then installing again"
    "${as_root[@]}" apt-get update -q && \
        "${as_root[@]}" apt-get install -y -q --no-install-recommends chromium fonts-liberation
}
if [ ! -x /usr/bin/chromium ]; then
    install_chromium || echo "bootstrap: WARNING: chromium is not installed; tests/test_browser.py will fail." \
        "Install it with: apt-get install -y --no-install-recommends chromium" >&2
fi
