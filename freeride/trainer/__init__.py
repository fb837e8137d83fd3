"""Deprecated: the reference trainer is :mod:`freeride.workload` (``python -m freeride.workload``).

Importing ``freeride.trainer`` warns and gives its public names; its submodules are aliases of
``freeride.workload``'s.
"""

import warnings

from freeride.workload.run import TrainerConfig, main, train

warnings.warn("freeride.trainer is now freeride.workload (the reference workload); import it from there "
              "(this alias goes away in a later release)", DeprecationWarning, stacklevel=2)

__all__ = ["TrainerConfig", "main", "train"]
