"""Deprecated alias of :mod:`freeride.training.planner`."""

from freeride._compat import moved

moved(__name__, "freeride.training.planner")
