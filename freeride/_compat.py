"""Old import paths that still work, with a DeprecationWarning naming the new one."""

from __future__ import annotations

import importlib
import runpy
import sys
import warnings


def moved(old: str, new: str) -> None:
    """Make module ``old`` an alias of module ``new`` (every name, private ones too), and warn once.

    Run as a program (``python -m`` the old path, so ``old`` is ``__main__``), it says the new path
    on stderr and runs that as ``__main__``: the old command keeps doing what it did.
    """
    if old == "__main__":
        main = sys.modules["__main__"]
        spec = getattr(main, "__spec__", None)
        name = spec.name if spec is not None else "this module"
        print(f"freeride: `python -m {name}` is now `python -m {new}`; running that", file=sys.stderr)
        runpy.run_module(new, run_name="__main__", alter_sys=True)
        return
    warnings.warn(f"{old} moved to {new}; import it from there (the old path goes away in a later release)",
                  DeprecationWarning, stacklevel=3)
    sys.modules[old] = importlib.import_module(new)
