"""Deprecated alias of :mod:`freeride.workload.memory_probe`."""

from freeride._compat import moved

moved(__name__, "freeride.workload.memory_probe")
