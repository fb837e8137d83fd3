#!/usr/bin/env bash
# Create (or reuse) the virtual environment and install freeride into it.
# torch is installed first, pinned to 2.13.0: on CPU machines that is a CPU build on local disk,
# and with it in place the package's torch>=2.4 requirement never pulls a multi-GB CUDA build.
# The cluster queue's tests start a real redis-server: installed here with apt when it is missing
# and we run as root (CI); otherwise a message says how to install it.
# Source this file: it leaves the environment activated.
# FREERIDE_SETUP=demo (scripts/demo.sh) installs only what `freeride demo` needs: torch and freeride[demo],
# no test tools, frameworks or redis-server; the default, test, installs everything the tests use.
VENV=${FREERIDE_VENV:-.venv}
SETUP=${FREERIDE_SETUP:-test}
case $SETUP in
    test|demo) ;;
    *) echo "setup: FREERIDE_SETUP must be test or demo, not '$SETUP'" >&2; return 2 2>/dev/null || exit 2 ;;
esac
if [ "$SETUP" = test ] && ! command -v redis-server >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        echo "setup: installing redis-server (the cluster queue's tests start a real one)"
        export DEBIAN_FRONTEND=noninteractive
        apt-get install -y -q redis-server >/dev/null 2>&1 \
            || { apt-get update -q >/dev/null && apt-get install -y -q redis-server >/dev/null; } \
            || echo "setup: could not install redis-server with apt-get; the cluster-queue tests will fail" >&2
    else
        echo "setup: redis-server is not installed; the cluster-queue tests need it" \
             "(Debian/Ubuntu: sudo apt-get install redis-server). Without it they are skipped, or fail under CI." >&2
    fi
fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
# For the tests, with the frameworks the adapters' tests run (pinned CPU-capable versions). A constraint holds
# torch at the build in place, so a framework's own torch requirement can never replace it (with a CUDA build):
# pip fails instead. torchtitan (Python >= 3.11) goes in alone: its declared dependencies are its
# trainer's (datasets, wandb, ...), not its pipeline builder's.
if [ "$SETUP" = demo ]; then extras=demo; else extras=test,test-deepspeed,test-torchtitan; fi
torch_pin=$(mktemp)
# From its metadata: importing torch before NumPy is here warns; a torch without metadata is imported.
python -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" >"$torch_pin" 2>/dev/null \
    || python -c "import torch; print('torch==' + torch.__version__)" >"$torch_pin"
python -m pip install -q -c "$torch_pin" -e ".[$extras]"
rm -f "$torch_pin"
if [ "$SETUP" = test ] && python -c "import sys; sys.exit(sys.version_info < (3, 11))"; then
    python -m pip install -q --no-deps "torchtitan==0.3.0" \
        || echo "setup: could not install torchtitan 0.3.0; its adapter's tests will be skipped (fail under CI)" >&2
fi
# Megatron Core for the Megatron adapter's tests, pinned (the [test] extra installs it on Python >= 3.12,
# which its release declares; it runs on 3.11 too). --no-deps: its dependencies (torch, numpy, packaging)
# are already here, and pip must never swap the CPU torch for a CUDA build. No triton (691 MB): the tests
# stand in for the one kernel module that imports it (examples/megatron_cpu.py).
[ "$SETUP" = demo ] \
    || python -c "import importlib.metadata as m, sys; sys.exit(m.version('megatron-core') != '0.19.2')" 2>/dev/null \
    || python -m pip install -q --no-deps --ignore-requires-python "megatron-core==0.19.2" \
    || echo "setup: could not install megatron-core 0.19.2; the Megatron adapter's tests will fail under CI" >&2
# On an NVIDIA machine (or with FREERIDE_GPU=1): CuPy built for the CUDA major version that torch uses.
if [ "${FREERIDE_GPU:-}" = 1 ] || { [ "${FREERIDE_GPU:-}" != 0 ] && command -v nvidia-smi >/dev/null 2>&1; }; then
    cuda_major=$(python -c "import torch; print((torch.version.cuda or '').split('.')[0])")
    case $cuda_major in
        12|13) python -m pip install -q -e ".[$SETUP,cuda$cuda_major]" \
                   || echo "setup: could not install CuPy for CUDA $cuda_major (freeride[cuda$cuda_major])" >&2 ;;
        *) echo "setup: torch has no CUDA ${cuda_major:+($cuda_major) }that CuPy is built for; no CuPy" >&2 ;;
    esac
fi
