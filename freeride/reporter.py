"""Deprecated alias of :mod:`freeride.training.reporter`."""

from freeride._compat import moved

moved(__name__, "freeride.training.reporter")
