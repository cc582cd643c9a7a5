"""vLLM's periodic engine stats line (off with ``--disable-log-stats``): every
interval while the engine has work, or once more when it has just gone idle,
so an idle server does not fill its log."""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

from pagedserve.common.messages.frontend import EngineStats


def stats_line(s: EngineStats) -> str:
    used = s.num_gpu_blocks - s.num_free_gpu_blocks
    kv = 100.0 * used / s.num_gpu_blocks if s.num_gpu_blocks else 0.0
    hit = 100.0 * s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
    return (f"Running: {s.num_running} reqs, Swapped: {s.num_swapped} reqs, Waiting: {s.num_waiting} reqs, "
            f"KV cache usage: {kv:.1f}%, Prefix cache hit rate: {hit:.1f}%, Preemptions: {s.num_preemptions}, "
            f"Steps: {s.num_steps}")


async def log_stats_every(interval_s: float, last: Callable[[], EngineStats | None], log: logging.Logger) -> None:
    steps = None
    while True:
        await asyncio.sleep(interval_s)
        s = last()
        if s is None or steps is None or s.num_steps == steps:  # no step since the last look: nothing new
            steps = None if s is None else s.num_steps
            continue
        steps = s.num_steps
        log.info("%s", stats_line(s))
