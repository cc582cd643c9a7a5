"""Packed weights in 2 MiB pages.

A decode step of a few rows streams every weight once, and that read is
most of its time. Read from 4 KiB pages, the stream takes a TLB miss every
4 KiB and the hardware prefetchers stop at each page's edge; from
transparent huge pages neither happens. Linux backs anonymous memory with
them only where ``madvise(MADV_HUGEPAGE)`` asks when THP is ``madvise``
(most distributions' default, and this VM's), and torch's allocator does
not ask unless ``THP_MEM_ALLOC_ENABLE`` is set. So the CPU kernels' packing
functions write into mappings advised to use them. Measured on the 2-core
EPYC (2026-12-07, ``python -m benchmarks huge-pages``: a 1B decode step's
linears from a copy in each kind of page, in turn, in one process): bf16
panels 1.03-1.05x at 1-16 rows and Q8_0 blocks 1.02-1.04x at a read rate of
~50 GB/s, up to 1.16x at ~75 GB/s; ~1.0x at 32 rows (compute-bound).

``small_pages()`` leaves them in 4 KiB pages (for that A/B).
"""
from __future__ import annotations

import math
import mmap
from collections.abc import Iterator
from contextlib import contextmanager

import torch

HUGE_PAGE = 1 << 21  # x86-64's transparent huge page
_huge = True  # off inside small_pages()


def thp_mode() -> str:
    """The kernel's THP setting: always, madvise, never, or absent (not Linux, or THP compiled out)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "absent"


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor for a weight about to be packed: from 2 MiB on, in
    an anonymous mapping of its own advised MADV_HUGEPAGE before anything touches
    it. (Advice holds only for pages not yet touched, and a chunk malloc hands
    back may be reused heap; a fresh mapping is also returned whole when freed.)"""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE") or not _huge:
        return torch.empty(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared would be shmem: no THP
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        pass  # THP compiled out: small pages, as torch.empty would give
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)  # the tensor keeps buf alive


@contextmanager
def small_pages() -> Iterator[None]:
    """Weights packed inside the block keep torch's 4 KiB pages (the A/B's other copy)."""
    global _huge
    before, _huge = _huge, False
    try:
        yield
    finally:
        _huge = before
