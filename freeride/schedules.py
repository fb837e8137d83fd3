"""Deprecated alias of :mod:`freeride.training.schedules`."""

from freeride._compat import moved

moved(__name__, "freeride.training.schedules")
