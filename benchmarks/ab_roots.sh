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
# PYTHONPATH is the root, then the working tree (for `benchmarks`, which an extracted root lacks), then
# whatever is already on it (e.g. /tmp/site with the GPU wheels). PYTHONSAFEPATH=1: `python -m` would
# otherwise put the working directory first, and the new root's package would shadow the old one.
set -euo pipefail
old=$(cd "$1" && pwd); rounds=$2; out=$3; shift 3
[ "${1:-}" = "--" ] && shift
new=$(pwd)
base=${PYTHONPATH:-}
for ((k = 1; k <= rounds; k++)); do
  if ((k % 2)); then order="old new"; else order="new old"; fi
  for which in $order; do
    root=$new; [ "$which" = old ] && root=$old
    path="$root:$new${base:+:$base}"
    where=$(cd / && PYTHONSAFEPATH=1 PYTHONPATH="$path" python3 -c 'import autodeploy_mla, os; print(os.path.dirname(os.path.dirname(autodeploy_mla.__file__)))')
    [ "$where" = "$root" ] || { echo "autodeploy_mla imports from $where, not from $root" >&2; exit 1; }
    echo "=== round $k: $which ($root)"
    PYTHONSAFEPATH=1 PYTHONPATH="$path" "$@" --out "$out/$which$k"
  done
done
