"""Deprecated alias of :mod:`freeride.workload.run`."""

from freeride._compat import moved

moved(__name__, "freeride.workload.run")
