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
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if ! .venv/bin/python -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null; then
    "${PIP[@]}" "torch==2.13.0"
fi
"${PIP[@]}" -c scripts/constraints.txt -e ".[test]"
