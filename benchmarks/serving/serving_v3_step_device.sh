#!/usr/bin/env bash
# Why the 4-layer DeepSeek-V3 decode step measured 8.0 ms at batch 64 on 2026-11-29 (2.1 ms on
# 11-28), and whether the Gluon decode kernels still compile variants after a complete start:
#   1. the GPU tests of the serving, start-up, sampler and Gluon-decode code;
#   2. v3_4layer in process with EMPTY compile caches (as the 11-28 run was), torch-profiled steps;
#   3. v3_4layer in process again with those caches WARM (as the 11-29 run was), profiled;
#   4. v3_4layer `autodeploy serve` (warm) + HTTP c64/c16, then the Triton kernels compiled after it;
#   5. GLM-4.7-Flash (47 layers) start-up to a ready /health, fresh caches (GLM=0 skips it).
# Usage, on the device machine after installing the wheels (benchmarks/device_wheels.sh):
#   bash benchmarks/serving/serving_v3_step_device.sh OUT_DIR
set -u
out=${1:?usage: benchmarks/serving/serving_v3_step_device.sh OUT_DIR}
w=$(mktemp -d)
s="python3 -m benchmarks.serving.serving_http --out $w"
names() { find "$1" -path '*triton*' -name '*.json' ! -name '__grp__*' -printf '%f\n' 2>/dev/null | sort; }
timeout ${GPU_TESTS_S:-200} python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_gluon_decode.py \
  tests/test_triton_lean_path.py tests/test_sampling_features.py tests/test_startup.py tests/test_server.py 2>&1 | tail -4
export AUTODEPLOY_CACHE_DIR=/tmp/adc_v3
AUTODEPLOY_CACHE_DIR=/tmp/adc_v3 timeout 200 $s --model v3_4layer --phases inproc --label fresh --torch-profile 2>&1 \
  | grep "^in-process\|^step" | cut -c1-400
timeout 150 $s --model v3_4layer --phases inproc --label warm --torch-profile 2>&1 | grep "^in-process\|^step" | cut -c1-400
names "$AUTODEPLOY_CACHE_DIR" > "$w/kernels_before_serve.txt"
timeout 150 $s --model v3_4layer --phases serve --label serve 2>&1 | grep "^http\|ready" | cut -c1-330
names "$AUTODEPLOY_CACHE_DIR" > "$w/kernels_after_serve.txt"
echo "Triton kernels compiled by the v3 HTTP runs after a complete start:"
comm -13 "$w/kernels_before_serve.txt" "$w/kernels_after_serve.txt" | uniq -c | sort -rn | head
for f in "$w"/step_b64_*profile.txt; do echo "== $f"; head -16 "$f" | cut -c1-160; done
tar czf "$out/serving_v3_step_runs.tgz" -C "$w" .
if [ "${GLM:-1}" != 0 ]; then
  AUTODEPLOY_CACHE_DIR=/tmp/adc_glm timeout ${GLM_S:-240} $s --model glm_4_7_flash --phases startup --label fresh 2>&1 | tail -1
  tar czf "$out/serving_v3_step_runs.tgz" -C "$w" .
fi
grep -h "ready after\|start-up: \(load\|compile (\|capture\|warm\)" "$w"/*serve.log | cut -c1-200
