"""The reference workload: a small GPT split into pipeline stages, instrumented with freeride.training.

Run one process per stage under ``torchrun`` (gloo on CPU, each rank pinned to core ==
local rank; NCCL on GPU)::

    torchrun --nproc-per-node 2 -m freeride.workload --microbatches 4 --iterations 20 \\
        --schedule 1f1b --report --device cpu --iteration-log /tmp/train.jsonl

With ``--report`` every rank streams its bubbles to the manager of its own device
(``cpu:<local_rank>`` or ``cuda:<local_rank>``) at the default endpoint or ``--endpoint-template``.
Each rank writes one JSON line per iteration (time, loss, measured bubbles) to its log file.
It is the demo's main job and the benchmarks' workload.
"""

from freeride.workload.run import TrainerConfig, main, train

__all__ = ["TrainerConfig", "main", "train"]
