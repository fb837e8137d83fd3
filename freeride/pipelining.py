"""Deprecated alias of :mod:`freeride.training.instrument`."""

from freeride._compat import moved

moved(__name__, "freeride.training.instrument")
