"""Old import paths that still work, with a DeprecationWarning naming the new one."""

from __future__ import annotations

import importlib
import sys
import warnings


def moved(old: str, new: str) -> None:
    """Make module ``old`` an alias of module ``new`` (every name, private ones too), and warn once."""
    warnings.warn(f"{old} moved to {new}; import it from there (the old path goes away in a later release)",
                  DeprecationWarning, stacklevel=3)
    sys.modules[old] = importlib.import_module(new)
