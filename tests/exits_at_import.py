"""A task module that exits at import: ``sys.exit(7)``, or a KeyboardInterrupt with ``$FR_TEST_INTERRUPT``."""

import os
import sys

from sample_tasks import Counter

if os.environ.get("FR_TEST_INTERRUPT"):
    raise KeyboardInterrupt("interrupted at import")
sys.exit(7)


class Task(Counter):
    pass
