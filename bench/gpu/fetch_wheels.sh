#!/usr/bin/env bash
# Download, where there is a network, the wheels the lent GPU machine may lack: exactly those pinned in
# bench/gpu/wheels.txt, built for ITS Python (CPython 3.12 on x86-64 Linux; PY_VERSION overrides),
# whatever Python runs here. They land in .whl/ (git-ignored; carry it with the device tool's `carry`);
# bench/gpu/ensure_deps.py installs there only the ones whose requirement is unmet. Never commit them.
# A pin in SOURCE_ONLY has no wheel on PyPI (DeepSpeed publishes only its source): it is built here,
# without build isolation (its setup imports torch: the one here, never a downloaded CUDA build) and
# without its kernels (DS_BUILD_OPS=0: they are compiled where first used), into a py3-none-any wheel.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY_VERSION=${PY_VERSION:-3.12}
PIP=${PIP:-python3 -m pip}
SOURCE_ONLY=(deepspeed)
mapfile -t pins < <(grep -v '^\s*#' bench/gpu/wheels.txt | grep -v '^\s*$')
binary=() built=()
for pin in "${pins[@]}"; do
    if [[ " ${SOURCE_ONLY[*]} " == *" ${pin%%==*} "* ]]; then built+=("$pin"); else binary+=("$pin"); fi
done
mkdir -p .whl
rm -f .whl/*.whl
# shellcheck disable=SC2086
$PIP download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${binary[@]}"
if [ ${#built[@]} -gt 0 ]; then
    # shellcheck disable=SC2086
    DS_BUILD_OPS=0 $PIP wheel -q --no-deps --no-build-isolation -w .whl "${built[@]}"
fi
ls -l .whl
