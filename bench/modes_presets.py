"""The modes bench's presets (``python -m bench.bench_modes --preset NAME``) and the side tasks sized
like the reference system's own.

Each preset is one command that writes its own results (``bench/results/cpu/<stem>.json``, ``.md``,
``.png``) and, with ``--update-readme README.md``, its own generated block of the README:

* ``full`` (the default): every task set and mode at the short bubbles of a CPU emulation (stage 1 of a
  4-stage 1F1B pipeline with 8 micro-batches, 3-25 ms a bubble); 35 minutes on two cores.
* ``short``: the same comparison on two task sets (``pagerank``, ``mix``) in three trials: about 7
  minutes on two quiet cores (estimated from the full run's 16 s a run). The preset to try first.
* ``reference-scale``: the comparison with the reference policy **at the reference's own bubble scale**
  (its paper reports bubbles of 0.22-1.04 s): the emulated neighbours take 200 ms a forward and 400 ms a
  backward (``--peer-forward-ms 200 --peer-backward-ms 400``, 4 micro-batches), which gives stage 1
  bubbles of about 0.55-0.8 s, and the side tasks are sized like the reference's (:data:`REFERENCE_SIZED`:
  steps of tens to hundreds of milliseconds, where its own were 31-175 ms). There its 5 ms sleep after
  each step costs a few percent of a bubble, not half of it, and its 10 ms poll a few percent of the
  bubble's start: the like-for-like comparison. Only ``none``, ``freeride-paper`` and ``freeride`` run
  (co-location and the managers' own overhead are the other presets' business); 13 minutes on two
  quiet cores (measured: 3 trials of 7 runs of about 35 s).

Explicit options override a preset's values (``--preset short --max-trials 5``).
"""

from __future__ import annotations

from typing import Any

MiB = 2**20
#: A task that never finishes within a run (its own ``max_steps`` would otherwise end it).
ENDLESS = 10**7

#: Side tasks sized like the reference's (its GPU steps: ResNet-18 30.6 ms, ResNet-50 88.9 ms, VGG-19
#: 175 ms), as steps of the bundled CIFAR ResNet-18 training on one CPU core: its ``width`` and
#: ``batch_size`` set the step. On this project's 2-core VM these measured about 25-40, 90-180 and
#: 200-450 ms depending on the machine's load; every run records what they measured
#: (``standalone_step_ms`` in the results), and the README quotes those figures.
REFERENCE_SIZED: dict[str, tuple[str, dict[str, Any], int]] = {
    "resnet-small": ("side_tasks.training:ResNet18Training",
                     {"width": 8, "batch_size": 4, "max_steps": ENDLESS}, 768 * MiB),
    "resnet-medium": ("side_tasks.training:ResNet18Training",
                      {"width": 16, "batch_size": 8, "max_steps": ENDLESS}, 768 * MiB),
    "resnet-large": ("side_tasks.training:ResNet18Training",
                     {"width": 16, "batch_size": 12, "max_steps": ENDLESS}, 768 * MiB),
}
REFERENCE_SETS: dict[str, tuple[str, ...]] = {name: (name,) for name in REFERENCE_SIZED}

#: The default stem of the results files, and of the README block, for the default preset.
DEFAULT_STEM = "modes"

PRESETS: dict[str, dict[str, Any]] = {
    "full": {},
    "short": {
        "task_sets": "pagerank,mix", "min_trials": 3, "max_trials": 3, "budget_min": 8.0, "stem": "modes_short",
        "label": "the short preset: two task sets, three trials",
    },
    "reference-scale": {
        "stage": "1/4/4", "peer_forward_ms": 200.0, "peer_backward_ms": 400.0, "iterations": 7, "warmup": 2,
        "task_sets": ",".join(REFERENCE_SETS), "modes": "none,freeride-paper,freeride", "min_trials": 3,
        "max_trials": 3, "budget_min": 20.0, "standalone_s": 3.0, "stem": "modes_reference",
        "label": "the reference's bubble scale: neighbours of 200/400 ms, side tasks sized like the reference's",
    },
}


def preset_command(preset: str) -> str:
    """The command that runs a preset and rewrites its README block."""
    flag = "" if preset == "full" else f" --preset {preset}"
    return f"python -m bench.bench_modes{flag} --update-readme README.md"
