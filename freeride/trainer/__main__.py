"""Deprecated: ``python -m freeride.trainer`` is ``python -m freeride.workload``; this still runs it."""

import runpy
import sys

print("freeride: `python -m freeride.trainer` is now `python -m freeride.workload`; running that",
      file=sys.stderr)
runpy.run_module("freeride.workload", run_name="__main__", alter_sys=True)
