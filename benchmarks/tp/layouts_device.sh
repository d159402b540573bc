#!/usr/bin/env bash
# Issue 47's GPU measurements in one device call per phase (each run in processes of its own, each
# bounded so the call ends inside its 600 s; what finished is in the tarball either way):
#   PHASE=decode: GLM-4.7-Flash batch 64 x 1k decode, one GPU and every world size in WORLDS
#                 (data-parallel attention + expert-parallel experts, ep_collective auto), profiled;
#   PHASE=serve:  the same layout served (`serving_http --world-size N`, 64 streams) next to one GPU
#                 served the same way (the 2-GPU HTTP run of 2026-11-29 had no one-GPU run beside it);
#   PHASE=v2:     DeepSeek-V2 236 B decode at batch 64 / 256 over WORLDS, against the per-rank byte floor.
#                 8 GPUs: at 4 each rank would hold ~124 GiB of weights (a quarter of the experts plus
#                 the replicated attention, ~17 GiB), too close to the H200's 139 GiB with a cache.
# Then merge with benchmarks/tp/parallel_layouts_report.py (see benchmarks/tp/parallel_layouts_report.sh).
# Usage on the device, after `source benchmarks/device_setup.sh <commit>`:
#   PHASE=decode WORLDS="2 4" bash benchmarks/tp/layouts_device.sh $OUT
set -u
out=${1:?usage: layouts_device.sh OUT_DIR}
phase=${PHASE:-decode}
worlds=${WORLDS:-$([ "$phase" = v2 ] && echo 8 || echo 2)}  # v2: 8 GPUs (see above)
limit=${LIMIT:-585}  # seconds of the call this script may use
export AUTODEPLOY_CACHE_DIR=${AUTODEPLOY_CACHE_DIR:-/tmp/adc}
w=$(mktemp -d)
left() { echo $((limit - SECONDS)); }
run() {  # run NAME MAX_S CMD...: bounded by the time left; prints the last lines that matter
  local name=$1 max=$2; shift 2
  local l; l=$(left)
  if [ "$l" -lt 90 ]; then echo "$name: skipped ($l s left)"; return; fi
  timeout $((l < max ? l : max)) "$@" > "$w/$name.log" 2>&1
  echo "$name: rc $? at ${SECONDS}s"
  grep -hE '^\{"world|^world [0-9]+: [0-9]+s|ready after|^http c' "$w/$name.log" | cut -c1-600
}
dec="python3 -m benchmarks.tp.tp_decode --layout data --batches 64 --contexts 1024 --profile 1024,64 --steps 12 --warmup 3"
case $phase in
  decode)
    for n in $worlds; do run "w$n" 200 $dec --model glm_4_7_flash --world-sizes "$n" --out "$w/w$n"; done
    run w1 150 $dec --model glm_4_7_flash --world-sizes 1 --out "$w/w1" ;;
  serve)
    http="python3 -m benchmarks.serving.serving_http --model glm_4_7_flash --phases serve --concurrency 64"
    for n in $worlds; do
      run "serve_w$n" 260 $http --world-size "$n" --shard attention=data --shard experts=expert --shard mlp=replicate \
        --label "w$n" --out "$w/serve_w$n"
    done
    run serve_w1 220 $http --label w1 --out "$w/serve_w1" ;;
  v2)
    for n in $worlds; do
      run "v2_w$n" 560 python3 -m benchmarks.tp.tp_decode --model deepseek_v2 --layout data --world-sizes "$n" \
        --batches 64,256 --contexts 1024 --profile 1024,64 --steps 12 --warmup 3 --out "$w/v2_w$n"
    done ;;
  *) echo "PHASE must be decode, serve or v2 (got $phase)"; exit 2 ;;
esac
tar czf "$out/layouts_$phase.tgz" -C "$w" .
