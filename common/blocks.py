"""Block arithmetic every component shares (written once, not per call site)."""
from __future__ import annotations

# GPU block 0 is never handed out: the worker pads block tables and slot
# mappings with it, so a pool of N GPU blocks has N - 1 usable ones.
NULL_BLOCK = 0
NUM_RESERVED_GPU_BLOCKS = NULL_BLOCK + 1


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for non-negative ints (blocks for ``a`` tokens)."""
    return -(-a // b)


def usable_gpu_blocks(pool_blocks: int) -> int:
    return pool_blocks - NUM_RESERVED_GPU_BLOCKS


def kv_usage(num_free: int, num_usable: int) -> float:
    """Share of usable KV blocks in use (0 when there are none)."""
    return 1.0 - num_free / num_usable if num_usable else 0.0
