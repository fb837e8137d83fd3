"""Deprecated alias of :mod:`freeride.workload.model`."""

from freeride._compat import moved

moved(__name__, "freeride.workload.model")
