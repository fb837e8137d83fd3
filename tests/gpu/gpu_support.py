"""Support for the GPU tests: a real manager of ``cuda:0`` and real workers on the GPU.

Every test module here sets ``pytestmark = GPU``: marked ``gpu`` and skipped where there is no GPU.
Run them with ``pytest -m gpu`` (``bash bench/gpu/run.sh`` does, with the GPU measurements).
"""

from __future__ import annotations

import pytest


def _gpu_reason() -> str:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return ""


GPU_MISSING = _gpu_reason()
GPU = [pytest.mark.gpu, pytest.mark.skipif(bool(GPU_MISSING), reason=GPU_MISSING or "-")]
