#!/usr/bin/env bash
# Download, where there is a network, the wheels a GPU machine without one may lack: the gRPC stack at
# the versions the generated code needs, for CPython 3.12 on x86-64 Linux (the lent GPU machines'
# Python). They land in .whl/ (git-ignored); bench/gpu/ensure_deps.py installs the ones it lacks.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY_VERSION:-3.12}
mkdir -p .whl
want=()
for pkg in grpcio grpcio-health-checking protobuf; do
    want+=("$pkg==$(python3 -c "from importlib.metadata import version; print(version('$pkg'))")")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "${want[@]}"
ls -l .whl
