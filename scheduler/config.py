"""The scheduler's settings and the pool size it plans against. Their own module
so that the scheduler's mixins (preemption, results, intake) and ``core``
import them without importing each other."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    preemption_mode: str = "recompute"  # recompute | swap | auto
    enable_chunked_prefill: bool = True  # off: a prompt waits for a step its whole prefill fits in


@dataclass(frozen=True)
class PoolSize:
    """The KV pools as the worker sized them (WorkerReady): not configuration,
    since a restarted worker may size them differently (EngineCore.recover)."""

    num_gpu_blocks: int  # usable ones (the null block left out)
    num_cpu_blocks: int = 0
