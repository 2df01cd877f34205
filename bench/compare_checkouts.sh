#!/bin/bash
# The broker-side benchmarks on several checkouts of this repository, alternating, twice,
# so that before/after figures come from one run on one machine (docs/BENCHMARKS.md).
# Usage: bench/compare_checkouts.sh OUT_DIR CHECKOUT... (e.g. git worktrees of two commits);
# each script's output lands in OUT_DIR/<checkout name>.<benchmark>.<round>.
set -u
out=$1
shift
mkdir -p "$out"
python=${PYTHON:-python}
for round in 1 2; do
  for given in "$@"; do
    tree=$(cd "$given" && pwd)
    name=$(basename "$tree")
    echo "== $name round $round $(date +%T)" >>"$out/log"
    (
      cd "$tree" || exit 1
      export PYTHONPATH=$tree
      $python bench/bench_submit.py --scenario single --clients 32 --seconds 5 >"$out/$name.submit-single.$round" 2>&1
      $python bench/bench_submit.py --scenario batch --seconds 5 >"$out/$name.submit-batch.$round" 2>&1
      $python bench/bench_scheduler.py --waiting 100000 --rounds 10 >"$out/$name.scheduler.$round" 2>&1
      $python bench/bench_snapshot.py --tasks 200000 >"$out/$name.snapshot.$round" 2>&1
      $python bench/bench_e2e.py --systems steward --tasks 5000 --runs 1 >"$out/$name.e2e.$round" 2>&1
      $python bench/bench_roundtrip.py --systems steward >"$out/$name.roundtrip.$round" 2>&1
    )
  done
done
echo done >>"$out/log"
