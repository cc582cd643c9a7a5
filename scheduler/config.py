"""The scheduler's settings and the pool size it plans against. Their own module
so that the scheduler's parts (preemption, results, intake, ...) and ``core``
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
    # Hybrid KV cache: per KV cache group, 0 (full) or its sliding window; empty for dense models.
    kv_group_windows: tuple[int, ...] = ()

    @property
    def num_kv_groups(self) -> int:
        return len(self.kv_group_windows) or 1

    def table_blocks(self, num_blocks: int) -> int:
        """Blocks a running sequence whose tables are ``num_blocks`` long holds
        (an estimate for a hybrid KV cache: a sliding group about its window)."""
        if not self.kv_group_windows:
            return num_blocks
        bs = self.block_size
        return sum(num_blocks if w == 0 else min(num_blocks, -(-w // bs) + 1) for w in self.kv_group_windows)

    def blocks_held(self, num_tokens: int, chunk: int | None = None) -> int:
        """Blocks (all groups) a sequence of ``num_tokens`` holds at most, computing
        ``chunk`` tokens a step (default: max_num_batched_tokens); a dense model: its table."""
        bs = self.block_size
        full = -(-num_tokens // bs)
        if not self.kv_group_windows:
            return full
        c = min(num_tokens, chunk or self.max_num_batched_tokens)
        return sum(full if w == 0 else min(full, -(-(w + c) // bs) + 1) for w in self.kv_group_windows)


@dataclass(frozen=True)
class PoolSize:
    """The KV pools as the worker sized them (WorkerReady): not configuration,
    since a restarted worker may size them differently (EngineCore.recover)."""

    num_gpu_blocks: int  # usable ones (the null block left out)
    num_cpu_blocks: int = 0
