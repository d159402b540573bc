#!/usr/bin/env bash
# The issue-42 serving measurements on one GPU machine, in the order docs/benchmarks/serving_http.md
# reports them (each step in processes of its own; the compile caches start empty, so step 1 is the
# fresh-machine start and step 2 the start with the caches of an earlier run):
#   1. V2-Lite `autodeploy serve` from empty caches, to a ready /health (then stopped);
#   2. V2-Lite `autodeploy serve` again (warm caches), HTTP c64 / c16 / c64 from one client process,
#      py-spy of the API and engine processes during the first;
#   3. V2-Lite in process (per-token times, decode-step times at batch 64 / 16);
#   4. the 4-layer DeepSeek-V3 shape: serve + HTTP, then in process;
#   5. GLM-4.7-Flash (47 layers): fresh and warm start-up (GLM=0 skips it).
# Prints how many Triton kernels the cache holds after each step (kernels compiled after ready show
# up there). Usage, on the device machine after installing the wheels (benchmarks/device_wheels.sh):
#   bash benchmarks/serving/serving_http_device.sh OUT_DIR
set -u
out=${1:?usage: serving_http_device.sh OUT_DIR}
export AUTODEPLOY_CACHE_DIR=${AUTODEPLOY_CACHE_DIR:-/tmp/adc}
w=$(mktemp -d)
s="python3 -m benchmarks.serving.serving_http --out $w"
k() { echo "triton kernels cached after $1: $(find "$AUTODEPLOY_CACHE_DIR" -path '*triton*' -name '*.json' 2>/dev/null | wc -l)"; }
# the Triton kernels (by name, with their count) compiled between two snapshots: what ran first after ready
names() { find "$AUTODEPLOY_CACHE_DIR" -path '*triton*' -name '*.json' ! -name '__grp__*' -printf '%f\n' 2>/dev/null | sort; }
timeout 240 $s --model v2_lite --phases startup --label fresh 2>&1 | tail -1; k "v2_lite fresh"
timeout 240 $s --model v2_lite --phases serve --label warm --profile --single-client 2>&1 | grep "^http\|ready" | cut -c1-330
k "v2_lite warm + http"
timeout 180 $s --model v2_lite --phases inproc --label inproc 2>&1 | grep "^in-process\|^step" | cut -c1-250
names > "$w/kernels_before_v3.txt"
timeout 300 $s --model v3_4layer --phases startup --label v3start 2>&1 | tail -1
names > "$w/kernels_after_v3_start.txt"
timeout 300 $s --model v3_4layer --phases serve,inproc --label v3 --single-client 2>&1 | grep "^http\|ready\|^in-process\|^step" | cut -c1-330
names > "$w/kernels_after_v3_runs.txt"
echo "Triton kernels compiled by the v3 runs after a start that had compiled everything it knew of:"
comm -13 "$w/kernels_after_v3_start.txt" "$w/kernels_after_v3_runs.txt" | uniq -c | sort -rn | head -20
k "v3_4layer"
if [ "${GLM:-1}" != 0 ]; then
  timeout 300 $s --model glm_4_7_flash --phases startup --label fresh 2>&1 | tail -1
  timeout 200 $s --model glm_4_7_flash --phases startup --label warm 2>&1 | tail -1
fi
gzip -f "$w"/*.raw 2>/dev/null
tar czf "$out/serving_http_runs.tgz" -C "$w" .
grep -h "ready after\|start-up: \(load\|compile (\|capture\|warm\)\|engine process up" "$w"/*serve.log | cut -c1-200
