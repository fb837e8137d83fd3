"""Deprecated alias of :mod:`freeride.training.predictor`."""

from freeride._compat import moved

moved(__name__, "freeride.training.predictor")
