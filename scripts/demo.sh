#!/usr/bin/env bash
# The quick-start demo: a 2-stage pipeline (1F1B) on CPU cores 0 and 1 with bubble reporting on,
# one freeride manager per core, and side tasks harvesting the bubbles. Prints what happened.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
. scripts/setup.sh
ITERATIONS=${ITERATIONS:-40}
OUT=${OUT:-out/demo}
rm -rf "$OUT"; mkdir -p "$OUT"
pids=()
cleanup() { for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT
for dev in cpu:0 cpu:1; do
  freeride manager --device "$dev" --state-dir "$OUT/state-${dev/:/-}" 2>"$OUT/manager-${dev/:/-}.log" &
  pids+=($!)
done
for dev in cpu:0 cpu:1; do
  for _ in $(seq 100); do freeride health --device "$dev" >/dev/null 2>&1 && break; sleep 0.2; done
  freeride health --device "$dev"
done
echo "== submitting side tasks"
freeride submit side_tasks.graphs:PageRank --device cpu:0 --arg graph=rmat:12 --memory 512MiB --name pagerank
freeride submit examples.monte_carlo_pi:MonteCarloPi --device cpu:1 --arg batch=10000 --memory 512MiB --name pi
echo "== training: 2 stages, 1F1B, $ITERATIONS iterations, reporting bubbles"
torchrun --standalone --nproc-per-node 2 -m freeride.trainer --stages 2 --schedule 1f1b \
  --iterations "$ITERATIONS" --report --iteration-log "$OUT/iterations.jsonl"
for dev in cpu:0 cpu:1; do
  echo "== $dev"
  freeride bubbles --device "$dev"
  freeride stats --device "$dev"
  freeride ls --all --device "$dev"
done
