import sys

from freeride._worker.runtime import main

sys.exit(main())
