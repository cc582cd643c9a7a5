"""Attention and KV-cache kernels, imported as ``pagedserve.kernels``.

The torch reference (``reference.py``) is the CPU serving path; the Triton
kernels in ``triton_*.py`` serve CUDA and are tested against it.
``get_attention_backend`` picks between them for the worker.
"""
import os
from typing import Any

import torch

if not torch.cuda.is_available():
    # Triton has no CPU backend, so without CUDA its kernels can only run in
    # the interpreter; it must be chosen before any @triton.jit is decorated.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagedserve.kernels.backend import AttentionBackend, get_attention_backend, triton_backend  # noqa: E402
from pagedserve.kernels.reference import (  # noqa: E402
    copy_blocks_ref,
    paged_attention_ref,
    reshape_and_cache_ref,
    swap_blocks_ref,
)
from pagedserve.kernels.swap import swap_blocks  # noqa: E402

_TRITON_OPS = ("paged_attention", "copy_blocks", "reshape_and_cache")


def __getattr__(name: str) -> Any:
    # The Triton kernels load on first use, as the triton backend's: the CPU path runs without Triton.
    if name in _TRITON_OPS:
        return getattr(triton_backend(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AttentionBackend",
    "copy_blocks",
    "copy_blocks_ref",
    "get_attention_backend",
    "paged_attention",
    "paged_attention_ref",
    "reshape_and_cache",
    "reshape_and_cache_ref",
    "swap_blocks",
    "swap_blocks_ref",
]
