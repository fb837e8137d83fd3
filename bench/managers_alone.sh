#!/usr/bin/env bash
# What managers with no side task cost a trainer: bench/interleaved_trainer.py alone, then instrumented beside a
# manager per device, ROUNDS times alternating; MGR_OPTS passes manager options (--idle-read-ms 0: every event
# read at once, as managers did before they read late with no task resident). Prints each run's iteration p50.
#   bash bench/managers_alone.sh                          # the default manager
#   MGR_OPTS="--idle-read-ms 0" bash bench/managers_alone.sh
set -u
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
RT=$(mktemp -d /tmp/frov-XXXX)
export XDG_RUNTIME_DIR=$RT
pids=()
for d in 0 1; do
  # shellcheck disable=SC2086
  freeride manager --device "cpu:$d" --state-dir "$RT/state$d" ${MGR_OPTS:-} > "$RT/m$d.log" 2>&1 &
  pids+=($!)
done
sleep 3
for round in $(seq "$ROUNDS"); do
  for mode in plain freeride; do
    flag=""; [ "$mode" = freeride ] && flag="--freeride"
    # shellcheck disable=SC2086
    out=$(torchrun --standalone --nproc-per-node 2 bench/interleaved_trainer.py $flag --iters 100 2>&1 | grep 'iter p50' | sort | tr '\n' ' ')
    echo "round $round $mode: $out"
  done
done
kill "${pids[@]}" 2>/dev/null; wait
rm -rf "$RT"
