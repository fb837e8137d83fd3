"""Helpers for the framework adapters' tests: the frameworks are real, installed as test extras."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest


def require_megatron() -> None:
    """Megatron Core installed, or: fail under CI (``$CI``: the setup installs it), skip elsewhere."""
    if importlib.util.find_spec("megatron") is not None and importlib.util.find_spec("megatron.core") is not None:
        return
    message = "Megatron Core is not installed (scripts/setup.sh installs it: megatron-core 0.19.2)"
    if os.environ.get("CI"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message + "; set CI to make this a failure")


@contextlib.contextmanager
def one_process_group() -> Iterator[None]:
    """An initialised one-process gloo group (in memory: no port): Megatron reads ranks through it."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


DOCS = Path(__file__).resolve().parents[2] / "docs" / "bubbles.md"


def docs_snippet(name: str, path: Path = DOCS) -> str:
    """The code block after ``<!-- snippet: NAME -->`` in ``path``: the code a user copies, run as written."""
    found = re.search(rf"<!-- snippet: {re.escape(name)} -->\s*```python\n(.*?)```", path.read_text(), re.S)
    assert found, f"no snippet {name!r} in {path}"
    return found.group(1)
