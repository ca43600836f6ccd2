#!/usr/bin/env bash
# Run a group of rlgraph's tests (tests/README.md says what each holds and when to run it):
#
#   bash scripts/test.sh            # the default run (what CI and the README's test line run)
#   bash scripts/test.sh slow       # the longer end-to-end runs
#   bash scripts/test.sh vllm       # every vLLM-on-CPU test
#   bash scripts/test.sh faults     # processes and nodes killed from outside
#   bash scripts/test.sh soak       # 200 steps with kills
#   bash scripts/test.sh bench      # benchmark smoke tests
#   bash scripts/test.sh all        # every group above, one after another, then a summary
#
# Extra arguments go to pytest (e.g. -x, -k NAME). Exits non-zero if any group failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || { echo "test: no .venv; run bash scripts/setup.sh --vllm=cpu first" >&2; exit 2; }

group="${1:-default}"
[ $# -gt 0 ] && shift
run() {  # run NAME PYTEST-ARGS...: one group, timed
    local name=$1; shift
    local start=$SECONDS
    echo "test: [$name] $PY -m pytest -q $*" >&2
    "$PY" -m pytest -q "$@"
    local rc=$?
    [ $rc = 5 ] && rc=0  # no test selected (e.g. -k matched none in this group) is not a failure
    SUMMARY+=("$(printf '%-8s %s in %ss' "$name" "$([ $rc = 0 ] && echo passed || echo "FAILED ($rc)")" $((SECONDS - start)))")
    return $rc
}

SUMMARY=()
status=0
case "$group" in
    default) run default "$@" || status=1 ;;
    slow|vllm|bench) run "$group" -m "$group" "$@" || status=1 ;;
    faults) run faults -m faults -s "$@" || status=1 ;;
    soak) run soak -m soak -s tests/reliability/test_soak.py "$@" || status=1 ;;
    all)
        run default "$@" || status=1
        run slow -m slow "$@" || status=1
        run faults -m faults -s "$@" || status=1
        run bench -m bench "$@" || status=1
        run soak -m soak -s tests/reliability/test_soak.py "$@" || status=1
        ;;
    *) echo "test: unknown group $group (default, slow, vllm, faults, soak, bench, all)" >&2; exit 2 ;;
esac
printf 'test: %s\n' "${SUMMARY[@]}" >&2
exit $status
