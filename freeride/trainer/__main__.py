"""``python -m freeride.trainer``: see :mod:`freeride.trainer.run`.

``python -m freeride.trainer --single-stage ...`` runs :mod:`freeride.trainer.single_stage` instead
(one real stage on one device, its neighbours emulated; no torchrun).
"""

import sys

if "--single-stage" in sys.argv[1:]:
    from freeride.trainer.single_stage import main as single_stage_main

    sys.exit(single_stage_main([a for a in sys.argv[1:] if a != "--single-stage"]))

from freeride.trainer.run import main

sys.exit(main())
