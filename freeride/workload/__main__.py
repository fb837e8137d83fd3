"""``python -m freeride.workload``: see :mod:`freeride.workload.run`.

``python -m freeride.workload --single-stage ...`` runs :mod:`freeride.workload.single_stage` instead
(one real stage on one device, its neighbours emulated; no torchrun).
"""

import sys

if "--single-stage" in sys.argv[1:]:
    from freeride.workload.single_stage import main as single_stage_main

    sys.exit(single_stage_main([a for a in sys.argv[1:] if a != "--single-stage"]))

from freeride.workload.run import main

sys.exit(main())
