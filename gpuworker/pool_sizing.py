"""How many KV blocks the worker's pool gets: a fixed count, a memory size,
the CUDA memory left after a profiled forward, or the CPU default."""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from pagedserve.common.blocks import cdiv
from pagedserve.common.config import EngineConfig
from pagedserve.common.messages.types import SamplingParams
from pagedserve.gpuworker.cache_engine import CacheEngine
from pagedserve.gpuworker.inputs import attention_metadata
from pagedserve.gpuworker.seq_state import SeqState


def cpu_default_kv_bytes() -> int:
    """vLLM's CPU default (4 GiB), but at most a quarter of the machine's memory."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = 16 << 30
    return min(4 << 30, ram // 4)


def pool_blocks(cfg: EngineConfig, device: torch.device, max_model_len: int, per_block: int,
                free_cuda_bytes: Callable[[], int]) -> int:
    """This rank's pool size in blocks of ``per_block`` bytes; ``free_cuda_bytes``
    profiles the device (``profile_free_bytes``), called only on CUDA without a size given."""
    if cfg.num_gpu_blocks is not None:
        return cfg.num_gpu_blocks
    if cfg.kv_cache_memory is not None:
        n = cfg.kv_cache_memory // per_block
    elif device.type == "cuda":
        n = free_cuda_bytes() // per_block
    else:
        # Never more than max_num_seqs sequences of max_model_len can hold: a
        # tiny model would otherwise get millions of blocks to manage.
        full = cfg.max_num_seqs * cdiv(max_model_len, cfg.block_size) + 1
        n = min(cpu_default_kv_bytes() // per_block, full)
    if n < 2:
        raise ValueError(f"KV cache memory too small: {n} blocks of {per_block} bytes")
    return int(n)


@torch.inference_mode()
def profile_free_bytes(runner: Any) -> tuple[int, dict[str, int]]:
    """Run a forward of max_num_batched_tokens (and sampling-sized logits) to
    find the activation peak, then give gpu_memory_utilization of the
    device, minus weights, activations and non-torch memory, to the pool.
    ``runner``: the ModelRunner (its model, sampler and pool shape), not
    imported here; returns the free bytes and the profile."""
    cfg, dev = runner.cfg, runner.device
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    free0, total = torch.cuda.mem_get_info(dev)
    non_torch = (total - free0) - torch.cuda.memory_reserved(dev)
    n_tok = min(cfg.max_num_batched_tokens, cfg.max_num_seqs * runner.max_model_len)
    seq_len = min(n_tok, runner.max_model_len)
    n_seqs = cdiv(n_tok, seq_len)
    blocks_per_seq = cdiv(seq_len, cfg.block_size)
    scratch = CacheEngine(
        runner.num_layers, n_seqs * blocks_per_seq, 0, cfg.block_size, runner.num_kv_heads, runner.head_dim, runner.kv_dtype, dev,
        runner.backend,
    )
    lens = [seq_len] * (n_tok // seq_len) + ([n_tok % seq_len] if n_tok % seq_len else [])
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(len(lens))]
    meta, positions = attention_metadata(lens, [0] * len(lens), tables, cfg.block_size, runner.device)
    ids = torch.zeros(n_tok, dtype=torch.long, device=dev)
    hidden = runner.model(ids, positions, scratch.gpu, meta)
    logits = runner.model.compute_logits(hidden[: min(cfg.max_num_seqs, n_tok)])
    dummy = SeqState(0, [0], [], 0, SamplingParams(temperature=1.0, top_p=0.9, repetition_penalty=1.1), 1)
    runner.sampler(logits, [dummy] * logits.shape[0])
    torch.cuda.synchronize(dev)
    # The scratch pages stand in for part of the pool, so they are not activations.
    scratch_bytes = sum(t.numel() * t.element_size() for kv in scratch.gpu for t in kv)
    peak = torch.cuda.max_memory_allocated(dev) - scratch_bytes
    del scratch, hidden, logits
    torch.cuda.empty_cache()
    profile = {"total": total, "peak": peak, "non_torch": non_torch}  # reported by tests and bench
    return max(0, int(total * cfg.gpu_memory_utilization) - peak - non_torch), profile
