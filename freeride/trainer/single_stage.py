"""Deprecated alias of :mod:`freeride.workload.single_stage`."""

from freeride._compat import moved

moved(__name__, "freeride.workload.single_stage")
