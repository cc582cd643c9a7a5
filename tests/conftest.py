"""Test-wide setup. TRITON_INTERPRET must be set before any @triton.jit runs,
so it is decided here, before any pagedserve module is imported."""
from __future__ import annotations

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs CUDA (marked gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
