"""``python -m freeride.trainer``: see :mod:`freeride.trainer.run`."""

import sys

from freeride.trainer.run import main

sys.exit(main())
