"""Deprecated alias of :mod:`freeride.training.memory`."""

from freeride._compat import moved

moved(__name__, "freeride.training.memory")
