#!/usr/bin/env bash
# The CUDA path in one command, for the day a GPU host is lent (docs/gpu.md).
#
#   bash tools/gpu_check.sh OUT             on the GPU host: the wheels into a fresh target, every import, the
#                                           model, the CUDA tests (tests/gpu), the serving bench
#   bash tools/gpu_check.sh OUT --dry-run   here, without CUDA: the same wheels, for this Python, into a fresh
#                                           target, every import from it under a Python that has only the GPU
#                                           host's packages, the model built, the CUDA tests collected
#
#   --wheels DIR   the wheels (default .gpu-wheels, which `make gpu-wheels` fills; dry run .gpu-wheels-cpXY)
#   --offline      dry run: use the wheels there, never download (as on the GPU host)
#   --work DIR     keep the target, the host Python and the model there (default: a temp dir, removed)
#   PYTHON=...     the interpreter (default: python3, or python where only that one has torch)
#
# Each step writes OUT/<step>.log and a line of OUT/summary.txt; the tests and the bench write their figures
# (JSON) into OUT. The first failure stops the check with its reason (exit 1; 2 for a wrong command line),
# and what was written so far stays. All of it must fit in 8 minutes, so every step runs under a limit
# and the whole under VSUP_GPU_CHECK_BUDGET_S (450 s).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

usage() { echo "usage: bash tools/gpu_check.sh OUT [--dry-run] [--offline] [--wheels DIR] [--work DIR]" >&2; exit 2; }
OUT= DRY_RUN=0 OFFLINE=0 WHEELS= WORK=
while (( $# )); do
    case $1 in
        --dry-run) DRY_RUN=1 ;;
        --offline) OFFLINE=1 ;;
        --wheels) WHEELS=${2:-}; [[ -n $WHEELS ]] || usage; shift ;;
        --work) WORK=${2:-}; [[ -n $WORK ]] || usage; shift ;;
        -*) usage ;;
        *) [[ -z $OUT ]] || usage; OUT=$1 ;;
    esac
    shift
done
[[ -n $OUT ]] || usage
PY=${PYTHON:-python3}
if [[ -z ${PYTHON:-} ]] && ! python3 -c 'import importlib.util as u; assert u.find_spec("torch")' 2>/dev/null \
        && python -c 'import importlib.util as u; assert u.find_spec("torch")' 2>/dev/null; then
    PY=python
fi
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2
if [[ -z $WORK ]]; then
    WORK=$(mktemp -d -t vsup-gpu-check.XXXXXX) || exit 2
    trap 'rm -rf "$WORK"' EXIT
fi
mkdir -p "$WORK" && WORK=$(cd "$WORK" && pwd) || exit 2
SITE=$WORK/site  # the wheels go here, fresh every run
rm -rf "$SITE" "$WORK/host-python" "$WORK/model"
if [[ -z $WHEELS ]]; then
    if (( DRY_RUN )); then
        WHEELS=.gpu-wheels-$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")') || exit 2
    else
        WHEELS=.gpu-wheels
    fi
fi

BUDGET_S=${VSUP_GPU_CHECK_BUDGET_S:-450}
SUMMARY=$OUT/summary.txt
{
    echo "vsup GPU check$( (( DRY_RUN )) && echo ' (dry run)'), $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
    echo "wheels $WHEELS, budget $BUDGET_S s"
} > "$SUMMARY"

fail() {  # fail STEP REASON: the last line of the summary, and the end of the check
    printf '%-9s FAILED  %s\n' "$1" "$2" >> "$SUMMARY"
    echo "FAILED at $1: $2" >> "$SUMMARY"
    echo "gpu_check: FAILED at $1: $2 (logs in $OUT)" >&2
    exit 1
}

step() {  # step NAME LIMIT_S COMMAND...: run it into OUT/NAME.log under its limit; stop the check if it fails
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET_S - SECONDS))
    (( limit > left )) && limit=$left
    (( limit > 0 )) || fail "$name" "no time left of the $BUDGET_S s budget"
    echo "== $name (at most $limit s)"
    local started=$SECONDS
    timeout --kill-after=15 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local code=$?
    if (( code == 0 )); then
        printf '%-9s ok      %4d s\n' "$name" $((SECONDS - started)) >> "$SUMMARY"
        tail -n 2 "$OUT/$name.log"
        return
    fi
    tail -n 40 "$OUT/$name.log"
    local why="exit $code"
    (( code == 124 || code == 137 )) && why="timed out after $limit s"
    # the reason: the lines that say what failed, else the log's last line
    local said
    said=$(grep -E '^(FAILED|ERROR)|error:|Error:' "$OUT/$name.log" | tail -n 5 | paste -sd ';' -)
    [[ -n $said ]] || said=$(grep -v '^\s*$' "$OUT/$name.log" | tail -n 1)
    fail "$name" "$why: ${said:0:1500}"
}

if (( DRY_RUN )); then
    step host 60 "$PY" tools/gpu_host.py describe
    if (( ! OFFLINE )); then
        step download 180 "$PY" tools/gpu_host.py download "$WHEELS"
    fi
    step wheels 120 "$PY" tools/gpu_host.py install "$WHEELS" "$SITE"
    # a Python with only what a GPU host has: whatever else vsup imports must come from the wheels
    step python 60 "$PY" tools/gpu_host.py simulate "$WORK/host-python"
    RUN=$WORK/host-python/bin/python
else
    step host 60 "$PY" tools/gpu_host.py describe --require-cuda
    step wheels 120 "$PY" tools/gpu_host.py install "$WHEELS" "$SITE"
    RUN=$PY
fi
export PYTHONPATH=$SITE:$REPO  # the wheels first, then vsup and engine from this checkout (not installed)
step imports 120 "$RUN" tools/import_check.py "$SITE"
step model 120 "$RUN" -m tests.gpu.model "$WORK/model"

if (( DRY_RUN )); then
    step tests 120 "$RUN" -m pytest -p no:cacheprovider --collect-only -q tests/gpu
else
    step tests 300 env VSUP_REQUIRE_CUDA=1 VSUP_GPU_CHECK_MODEL="$WORK/model" VSUP_GPU_CHECK_OUT="$OUT" \
        "$RUN" -m pytest -p no:cacheprovider -o timeout=240 -v -rA --junitxml="$OUT/pytest.xml" tests/gpu
    step bench 240 "$RUN" bench/api_server.py --quick --parts a --device cuda --model "$WORK/model" \
        --concurrency 1,16,64 --results-dir "$OUT"
fi
echo "PASSED in $SECONDS s" >> "$SUMMARY"
echo "gpu_check: PASSED in $SECONDS s; figures and logs in $OUT"
