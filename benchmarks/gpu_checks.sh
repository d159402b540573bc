#!/usr/bin/env bash
# The GPU test pass, as run on the lent H200 machines (CI has no GPU): the `gpu`-marked tests plus
# `autodeploy build`, with logs written to $OUT (default /tmp/gpu_checks).
#
#   bash benchmarks/gpu_checks.sh          # the default GPU suite + autodeploy build: fits one 10-minute call
#   bash benchmarks/gpu_checks.sh full     # every GPU case, the slow ones too (tests/gpu_cases.py), split
#                                          # over the visible GPUs (4 x H200: one call; 1 GPU: ~25 min)
#   bash benchmarks/gpu_checks.sh tp       # 2-GPU tests (tests/test_tensor_parallel.py -m gpu)
#   bash benchmarks/gpu_checks.sh part 1/2 # the default suite's files split in 2 groups of about equal
#                                          # expected time (tests/gpu_cases.py), group 1 only: one call each
#
# The default suite on a fresh H200 (2026-11-29, 1cbdc93, one call of 537 s): 69 passed, 0 failed, pytest
# 486.6 s, then `autodeploy build` 27 s. `part 1/2` + `part 2/2` remain for a run with more tests.
#
# The default suite skips the cases tests/gpu_cases.py marks slow (pytest -m gpu does the same, see
# tests/conftest.py); its estimates (measured per test) sum to ~490 s on a fresh H200. Every pytest run prints --durations,
# so a run's log is what to correct those estimates with.
# A run that hangs is not silent: after its time limit every Python process of the run gets SIGABRT,
# and PYTHONFAULTHANDLER=1 makes each (spawned ranks included) print its stack before it dies.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
export PYTHONFAULTHANDLER=1 PYTHONUNBUFFERED=1
# every test phase's time, appended as it ends (tests/conftest.py): kept even when a run is cut short
export AUTODEPLOY_TEST_TIMES=${AUTODEPLOY_TEST_TIMES:-$OUT/test_times.tsv}

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

# full_groups N [default]: the GPU test files in N groups of about equal expected time (greedy, by the
# estimates of tests/gpu_cases.py plus ~15 s per slow entry), one line per group
full_groups() {
    python3 - "$1" <<'PY'
import collections, sys
sys.path.insert(0, "tests")
import gpu_cases
n = int(sys.argv[1])
default_only = len(sys.argv) > 2 and sys.argv[2] == "default"
cost = collections.Counter()
for key, s in gpu_cases.ESTIMATE_S.items():
    cost[key.split("::")[0]] += s
if not default_only:  # --slow runs the slow cases too: ~15 s each on top of the default estimate
    for key in gpu_cases.SLOW:
        cost[key.split("::")[0]] += 15
cost.pop("test_tensor_parallel.py", None)
groups = [[0, []] for _ in range(n)]
for f, c in sorted(cost.items(), key=lambda kv: -kv[1]):
    g = min(groups, key=lambda g: g[0])
    g[0] += c
    g[1].append("tests/" + f)
for c, files in groups:
    print(" ".join(files))
PY
}

PYTEST=(python3 -m pytest -q -m gpu -p no:cacheprovider --durations=30)
case "${1:-default}" in
tp)
    run "${TP_LIMIT:-300}" tp_tests.log python3 -m pytest -q -s -x -m gpu tests/test_tensor_parallel.py -p no:cacheprovider \
        --durations=10
    ;;
default | single)
    n=$(python3 -c "import torch; print(torch.cuda.device_count())")
    if [ "$n" -ge 2 ]; then  # two GPUs: the FlashInfer tests on one, the rest on the other
        CUDA_VISIBLE_DEVICES=0 run "${SINGLE_LIMIT:-450}" gpu_flashinfer.log \
            "${PYTEST[@]}" tests/test_flashinfer_backends.py tests/test_fp8_cache.py &
        CUDA_VISIBLE_DEVICES=1 run "${SINGLE_LIMIT:-450}" gpu_rest.log "${PYTEST[@]}" tests \
            --deselect tests/test_tensor_parallel.py --deselect tests/test_flashinfer_backends.py \
            --deselect tests/test_fp8_cache.py
        wait
    else
        run "${SINGLE_LIMIT:-450}" gpu_single.log "${PYTEST[@]}" tests --deselect tests/test_tensor_parallel.py
    fi
    CUDA_VISIBLE_DEVICES=0 run "${BUILD_LIMIT:-120}" build.log python3 -m autodeploy_mla.cli build --report "$OUT/build_report.json"
    ;;
full)
    n=$(python3 -c "import torch; print(max(1, torch.cuda.device_count()))")
    i=0
    while read -r files; do
        [ -n "$files" ] || continue
        # shellcheck disable=SC2086
        CUDA_VISIBLE_DEVICES=$i run "${FULL_LIMIT:-570}" "gpu_full_$i.log" "${PYTEST[@]}" --slow $files &
        i=$((i + 1))
    done < <(full_groups "$n")
    wait
    ;;
part)
    spec=${2:?usage: $0 part I/N}
    i=${spec%/*} n=${spec#*/}
    files=$(full_groups "$n" default | sed -n "${i}p")
    [ -n "$files" ] || { echo "part $spec: no such group" >&2; exit 2; }
    echo "part $spec: $files"
    # shellcheck disable=SC2086
    run "${SINGLE_LIMIT:-500}" "gpu_part_${i}_of_${n}.log" "${PYTEST[@]}" $files
    if [ "$i" = 1 ]; then
        run "${BUILD_LIMIT:-120}" build.log python3 -m autodeploy_mla.cli build --report "$OUT/build_report.json"
    fi
    ;;
*)
    echo "usage: $0 [default|full|tp|part I/N]" >&2
    exit 2
    ;;
esac
