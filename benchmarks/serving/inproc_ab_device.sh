#!/usr/bin/env bash
# A/B of the in-process step times of two package trees on one GPU machine, in separate processes,
# in the order B A B (A: this checkout; B: an older autodeploy_mla exported next to it). Made here with
#   rm -rf .ab_old && mkdir .ab_old && git archive <commit> autodeploy_mla model_configs | tar -x -C .ab_old
# (git-ignored: the device call names it, carry [".whl", ".ab_old"]); then on the device, after installing the wheels:
#   MODEL=v3_4layer bash benchmarks/serving/inproc_ab_device.sh OUT_DIR
# HEAD_ARGS: extra serving_http arguments for this checkout's runs only, e.g. HEAD_ARGS="--runtime
# prefix_caching=false" against a tree from before prefix caching was on by default (the in-process
# run repeats its prompts, so with the cache on this checkout would skip their prefill).
set -u
out=${1:?usage: inproc_ab_device.sh OUT_DIR}
model=${MODEL:-v3_4layer}
export AUTODEPLOY_CACHE_DIR=${AUTODEPLOY_CACHE_DIR:-/tmp/adc_ab}
run() {  # $1 label, $2 package root, then extra serving_http arguments
  # the package from $2, the benchmarks from this checkout (PYTHONSAFEPATH: the working directory,
  # which holds this checkout's autodeploy_mla, is not put first on sys.path)
  PYTHONSAFEPATH=1 PYTHONPATH="$2:$PWD:${PYTHONPATH:-}" timeout 200 python3 -m benchmarks.serving.serving_http \
    --out "$out" --model "$model" \
    --phases inproc --label "$1" --torch-profile "${@:3}" 2>&1 | grep "^in-process\|^step" | cut -c1-300 | sed "s/^/$1 /"
}
# ORDER: the runs, in order (default B A B); a label starting "head" runs this checkout, any other .ab_old
for label in ${ORDER:-old1 head old2}; do
  case $label in
  # shellcheck disable=SC2086
  head*) run "$label" "$PWD" ${HEAD_ARGS:-} ;;
  *) run "$label" "$PWD/.ab_old" ;;
  esac
done
