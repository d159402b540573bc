#!/usr/bin/env bash
# A/B of two code roots on one benchmark, alternating the roots (ABBA...) in one device call, so
# run-to-run drift of the machine shows up as spread instead of as a difference between versions.
#
#   bash benchmarks/ab_roots.sh OLD_ROOT ROUNDS OUTDIR -- python3 -m benchmarks.e2e.e2e_roofline --models v2_lite ...
#
# OLD_ROOT: a package tree extracted next to the repo, e.g.
#   mkdir -p .baseline_470ed57 && git archive 470ed57 autodeploy_mla model_configs | tar -x -C .baseline_470ed57
# (git-ignored; carry it to the device machine). The new root is the working tree. Each run gets
# `--out OUTDIR/<old|new><round>`; the benchmark script itself always comes from the working tree.
# PYTHONPATH keeps whatever is already on it (e.g. /tmp/site with the GPU wheels) after the root.
set -euo pipefail
old=$(cd "$1" && pwd); rounds=$2; out=$3; shift 3
[ "${1:-}" = "--" ] && shift
new=$(pwd)
base=${PYTHONPATH:-}
for ((k = 1; k <= rounds; k++)); do
  if ((k % 2)); then order="old new"; else order="new old"; fi
  for which in $order; do
    root=$new; [ "$which" = old ] && root=$old
    where=$(cd / && PYTHONPATH="$root${base:+:$base}" python3 -c 'import autodeploy_mla, os; print(os.path.dirname(os.path.dirname(autodeploy_mla.__file__)))')
    [ "$where" = "$root" ] || { echo "autodeploy_mla imports from $where, not from $root" >&2; exit 1; }
    echo "=== round $k: $which ($root)"
    PYTHONPATH="$root${base:+:$base}" "$@" --out "$out/$which$k"
  done
done
