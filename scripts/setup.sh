#!/usr/bin/env bash
# Set up a development environment in .venv: Graphviz's `dot`, CPU torch 2.13.0 (pinned first so
# no CUDA build is pulled in), then rlgraph with its test extras. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v dot >/dev/null 2>&1; then
    echo "setup: installing Graphviz (dot)" >&2
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq graphviz >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
pip_install() {
    # this machine's pip config names local indexes that may not exist: drop those warnings only
    .venv/bin/python -m pip install -q --disable-pip-version-check "$@" 2>&1 \
        | { grep -v "is ignored: it is neither a file nor a directory" || true; }
    return "${PIPESTATUS[0]}"
}
if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
    pip_install "torch==2.13.0"
fi
pip_install -c scripts/constraints.txt -e ".[test,deepspeed]"
