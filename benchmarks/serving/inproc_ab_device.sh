#!/usr/bin/env bash
# A/B of the in-process step times of two package trees on one GPU machine, in separate processes,
# in the order B A B (A: this checkout; B: an older autodeploy_mla exported next to it). Made here with
#   rm -rf .ab_old && mkdir .ab_old && git archive <commit> autodeploy_mla model_configs | tar -x -C .ab_old
# (untracked, so a device call carries it); then on the device, after installing the wheels:
#   MODEL=v3_4layer bash benchmarks/serving/inproc_ab_device.sh OUT_DIR
set -u
out=${1:?usage: inproc_ab_device.sh OUT_DIR}
model=${MODEL:-v3_4layer}
export AUTODEPLOY_CACHE_DIR=${AUTODEPLOY_CACHE_DIR:-/tmp/adc_ab}
run() {  # $1 label, $2 package root
  # the package from $2, the benchmarks from this checkout (PYTHONSAFEPATH: the working directory,
  # which holds this checkout's autodeploy_mla, is not put first on sys.path)
  PYTHONSAFEPATH=1 PYTHONPATH="$2:$PWD:${PYTHONPATH:-}" timeout 200 python3 -m benchmarks.serving.serving_http \
    --out "$out" --model "$model" \
    --phases inproc --label "$1" --torch-profile 2>&1 | grep "^in-process\|^step" | cut -c1-300 | sed "s/^/$1 /"
}
run old1 "$PWD/.ab_old"
run head "$PWD"
run old2 "$PWD/.ab_old"
