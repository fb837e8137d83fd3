#!/usr/bin/env bash
# Every GPU test and measurement, on a machine with one NVIDIA GPU and no network (the lent GPU
# machine: at most 10 minutes a command, 15 minutes of device time a session). The run is five
# commands, two to a session at most: 1 and 5 first (the most wanted), then 2 and 4, then 3. Each takes at
# most the sum of its steps' limits; `bash bench/gpu/run.sh --plan` prints them:
#
#   1. bash bench/gpu/run.sh deps bubbles demo tests                # <= 8.1 min
#   2. bash bench/gpu/run.sh deps adapters caps backends timing nccl # <= 7.7 min
#   3. bash bench/gpu/run.sh deps modes                             # <= 6.0 min
#   4. bash bench/gpu/run.sh deps park park-mps                     # <= 4.5 min
#   5. bash bench/gpu/run.sh deps clock tasks                       # <= 4.3 min
#
# (`--part N` is command N.) With the device tool: carry .whl (made here by bench/gpu/fetch_wheels.sh),
# one call per command, the second at once while the machine is warm, e.g.
# run(command="bash bench/gpu/run.sh --part 1", carry=[".whl"]).
# deps installs from .whl/ what the machine lacks; a step whose imports are still missing is skipped.
# Each step runs under its own time limit (killed with everything it started when it overruns) and,
# as soon as it ends, its results are under bench/results/gpu-<model>/ (NAME.json, NAME.md, NAME.log,
# steps.txt, machine.json) and packed into $OUT/gpu-results.tgz, so a command cut off returns every
# step it finished.
# The logic (steps, plan, dependency check, packing) is bench/gpu/steps.py, tested on CPU.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "$PY" -m bench.gpu.steps "$@"
