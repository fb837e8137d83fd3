#!/usr/bin/env bash
# Every GPU test and measurement, in one command, on a machine with one NVIDIA GPU and no network:
#
#   bash bench/gpu/run.sh            # all steps, in order (estimated 20-25 minutes on one H100; not yet run)
#   bash bench/gpu/run.sh tests caps # some of them
#
# Steps: deps (install what is missing from .whl/, see fetch_wheels.sh), tests (pytest -m gpu), caps,
# timing (step time against CUDA events), park (park and SIGSTOP tails), park-mps (the same as MPS
# clients, where an MPS daemon can be started), bubbles (device-timed bubbles against the profiler, and
# their cost), backends (CuPy against torch per bundled task), demo (freeride demo --quick on this GPU),
# modes (the bench's five modes on one real GPU stage, GPU-sized side tasks; a shortened run). Each step is bounded to under 10 minutes. Results go to
# bench/results/gpu-<model>/ with the machine, driver, CUDA and torch versions; where $OUT is set (the
# device tool), they are also packed into $OUT/gpu-results.tgz.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
STEP_LIMIT_S=${STEP_LIMIT_S:-570}
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(deps tests caps timing park park-mps bubbles backends demo modes)

if ! deps=$($PY bench/gpu/ensure_deps.py); then
    echo "missing dependencies and no wheels to install them from: see bench/gpu/fetch_wheels.sh" >&2
    exit 2
fi
eval "$deps"
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "no usable NVIDIA GPU here (torch.cuda.is_available() is false): nothing to measure" >&2
    exit 2
fi
results=$($PY -c "from bench.gpu.common import results_dir; print(results_dir())") || exit 2
$PY -c "import json; from bench.machine import machine_info; print(json.dumps(machine_info(), indent=2))" \
    > "$results/machine.json"
echo "results in $results"

run_step() {  # name, command...
    local name=$1; shift
    local started=$SECONDS
    echo "== $name: $*"
    timeout --kill-after=20 "$STEP_LIMIT_S" "$@" 2>&1 | tee "$results/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $((SECONDS - started)) s" | tee -a "$results/$name.log"
    status+=("$name=$rc")
}

status=()
for step in "${steps[@]}"; do
    case $step in
        deps) ;;  # done above, always
        tests) run_step tests $PY -m pytest -q -p no:cacheprovider -m gpu tests/gpu tests/trainer/test_single_stage.py \
                   --timeout 300 -rs ;;
        caps) run_step caps $PY -m bench.gpu.caps --seconds 10 ;;
        timing) run_step timing $PY -m bench.gpu.step_timing ;;
        park) run_step park $PY -m bench.gpu.park_tail --mps off --trials 20 ;;
        park-mps)
            export CUDA_MPS_PIPE_DIRECTORY=/tmp/freeride-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/freeride-mps-log
            mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
            if command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d; then
                run_step park-mps $PY -m bench.gpu.park_tail --mps require --trials 20
                echo quit | nvidia-cuda-mps-control
            else
                echo "no MPS here: nvidia-cuda-mps-control is missing or did not start" \
                    | tee "$results/park_tail-mps.md"
                status+=("park-mps=unavailable")
            fi
            unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY ;;
        bubbles) run_step bubbles $PY -m bench.gpu.bubble_timing ;;
        backends) run_step backends $PY -m bench.gpu.backends --seconds 10 ;;
        demo) run_step demo $PY -m freeride.cli demo --device cuda --quick --out "$results/demo" ;;
        modes) run_step modes $PY -m bench.bench_modes --single-stage cuda:0 --out "$results" --min-trials 2 \
                   --budget-min 4 --standalone-s 1 --label "GPU run (shortened to fit a 10-minute step)" ;;
        *) echo "unknown step $step" >&2; exit 2 ;;
    esac
done
echo "steps: ${status[*]}" | tee "$results/steps.txt"
if [ -n "${OUT:-}" ]; then
    tar czf "$OUT/gpu-results.tgz" -C "$(dirname "$results")" "$(basename "$results")"
fi
