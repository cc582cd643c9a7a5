"""Attention and KV-cache kernels, imported as ``pagedserve.kernels``.

The torch reference (``reference.py``) is the CPU serving path; the Triton
kernels in ``triton_*.py`` serve CUDA and are tested against it.
"""
from pagedserve.kernels.reference import (
    copy_blocks_ref,
    paged_attention_ref,
    reshape_and_cache_ref,
    swap_blocks_ref,
)

__all__ = ["copy_blocks_ref", "paged_attention_ref", "reshape_and_cache_ref", "swap_blocks_ref"]
