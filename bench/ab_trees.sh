#!/usr/bin/env bash
# Compare two checkouts of eosflow in one session, alternating (the machine is shared and noisy:
# only ratios within a run mean anything). Each tree runs bench/throughput.py with its own code.
#
#   bench/ab_trees.sh OLD_TREE NEW_TREE [ROUNDS] [-- extra throughput.py arguments]
#
# e.g. git worktree add /tmp/old 3dbddaf && bench/ab_trees.sh /tmp/old . 2
set -euo pipefail
old=$(cd "$1" && pwd); new=$(cd "$2" && pwd); rounds=${3:-2}
shift $(( $# < 3 ? $# : 3 )); [ "${1:-}" = "--" ] && shift
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(--records 2000000 --modes none,aligned --intervals 0.1,1
  --pipelines keyed_count --recovery-runs 0 --no-ceiling)
python=${PYTHON:-python}
for round in $(seq 1 "$rounds"); do
  for tree in "$old" "$new"; do
    echo "=== round $round tree $tree"
    (cd "$tree" && PYTHONPATH="$tree" "$python" bench/throughput.py "${args[@]}" \
      --out "$(mktemp -d)" 2>&1 | grep -E "records/s") || true
  done
done
