"""A task module that exits at import: ``sys.exit(7)``; a KeyboardInterrupt with ``$FR_TEST_INTERRUPT``, ``os._exit(7)``
with ``$FR_TEST_OS_EXIT``."""

import os
import sys

from sample_tasks import Counter

if os.environ.get("FR_TEST_INTERRUPT"):
    raise KeyboardInterrupt("interrupted at import")
if os.environ.get("FR_TEST_OS_EXIT"):
    os._exit(7)
sys.exit(7)


class Task(Counter):
    pass
