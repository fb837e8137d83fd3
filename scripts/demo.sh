#!/usr/bin/env bash
# The quick-start demo: set up .venv, then `freeride demo` (see `freeride demo --help`): a 2-stage
# 1F1B pipeline on CPU cores 0 and 1, trained once alone and once with a freeride manager per core
# and three side tasks in its bubbles; prints a summary and writes out/demo/{summary.json,
# timeline.png,trace.json}. Arguments go to `freeride demo`, e.g. --quick, --iterations N, --out DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
# Only what the demo needs (torch, freeride[demo]); `bash .ci/run` adds the tests' tools and frameworks.
export FREERIDE_SETUP=demo
# shellcheck disable=SC1091
. scripts/setup.sh
exec freeride demo "$@"
