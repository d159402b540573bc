#!/usr/bin/env bash
# The GPU test pass, as run on the lent H200 machines (CI has no GPU): every `gpu`-marked test plus
# `autodeploy build`, with logs written to $OUT (default /tmp/gpu_checks).
#
#   bash benchmarks/gpu_checks.sh tp       # 2-GPU tests (tests/test_tensor_parallel.py -m gpu)
#   bash benchmarks/gpu_checks.sh single   # 1-GPU tests, split over the visible GPUs, + autodeploy build
#
# A run that hangs is not silent: after its time limit every Python process of the run gets SIGABRT,
# and PYTHONFAULTHANDLER=1 makes each (spawned ranks included) print its stack before it dies.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
export PYTHONFAULTHANDLER=1 PYTHONUNBUFFERED=1

descendants() {
    local p
    for p in $(pgrep -P "$1"); do
        echo "$p"
        descendants "$p"
    done
}

# run LIMIT_S LOG CMD...: CMD with its output in $OUT/LOG; stacks dumped if it outlives LIMIT_S.
run() {
    local limit=$1 log=$2
    shift 2
    "$@" >"$OUT/$log" 2>&1 &
    local pid=$! t=0
    while kill -0 "$pid" 2>/dev/null && [ "$t" -lt "$limit" ]; do sleep 1; t=$((t + 1)); done
    if kill -0 "$pid" 2>/dev/null; then
        echo "TIMEOUT after ${limit}s: dumping stacks" >>"$OUT/$log"
        local tree
        tree="$pid $(descendants "$pid")"  # pytest and the ranks it spawned
        kill -ABRT $tree 2>/dev/null
        sleep 5
        kill -KILL $tree 2>/dev/null
    fi
    wait "$pid"
    local rc=$?
    echo "== $log: rc=$rc after ${t}s"
    tail -n 5 "$OUT/$log"
    return $rc
}

case "${1:-}" in
tp)
    run "${TP_LIMIT:-300}" tp_tests.log python3 -m pytest -q -s -x -m gpu tests/test_tensor_parallel.py -p no:cacheprovider
    ;;
single)
    n=$(python3 -c "import torch; print(torch.cuda.device_count())")
    if [ "$n" -ge 2 ]; then  # two GPUs: the FlashInfer tests on one, the rest on the other
        CUDA_VISIBLE_DEVICES=0 run "${SINGLE_LIMIT:-400}" gpu_flashinfer.log \
            python3 -m pytest -q -m gpu tests/test_flashinfer_backends.py -p no:cacheprovider &
        CUDA_VISIBLE_DEVICES=1 run "${SINGLE_LIMIT:-400}" gpu_triton_piecewise.log \
            python3 -m pytest -q -m gpu tests/test_triton_mla.py tests/test_piecewise.py -p no:cacheprovider
        wait
    else
        run "${SINGLE_LIMIT:-400}" gpu_single.log python3 -m pytest -q -m gpu tests -p no:cacheprovider \
            --deselect tests/test_tensor_parallel.py
    fi
    CUDA_VISIBLE_DEVICES=0 run "${BUILD_LIMIT:-120}" build.log python3 -m autodeploy_mla.cli build --report "$OUT/build_report.json"
    ;;
*)
    echo "usage: $0 tp|single" >&2
    exit 2
    ;;
esac
