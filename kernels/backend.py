"""Pick the attention/cache ops the worker runs: ``torch`` (the CPU serving
path: the compiled batched kernel or its vectorised torch fallback) or ``triton`` (the kernels; on CUDA, or on CPU in the
Triton interpreter, which tests use to force them). ``auto`` is triton on
CUDA and torch elsewhere, matching ``EngineConfig.attention_backend``."""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedserve.kernels.cpu_attention import paged_attention_cpu, paged_attention_sdpa
from pagedserve.kernels.reference import copy_blocks_ref, reshape_and_cache_ref
from pagedserve.kernels.swap import swap_blocks

BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class AttentionBackend:
    """The four ops with one signature each, whatever the implementation.
    ``paged_attention`` accepts the keyword hints ``max_seq_len`` and
    ``max_query_len`` in both backends (the torch one ignores them), and
    ``k_scale`` / ``v_scale`` (an fp8 pool's per-layer scales, ``fp8.py``),
    which ``reshape_and_cache`` takes too; and ``sliding_window``, ``softcap``
    and ``sinks`` (``reference.py``), given only by the families that use them."""

    name: str
    paged_attention: Callable[..., torch.Tensor]
    reshape_and_cache: Callable[..., None]
    copy_blocks: Callable[..., None]
    swap_blocks: Callable[..., torch.cuda.Event | None]


def _paged_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out=None,
                           *, max_seq_len: int | None = None, max_query_len: int | None = None,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           sliding_window: int | None = None, softcap: float | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    extras = dict(sliding_window=sliding_window, softcap=softcap, sinks=sinks)
    if q.device.type == "cpu":  # the compiled kernel, or its vectorised torch fallback
        return paged_attention_cpu(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out,
                                   k_scale=k_scale, v_scale=v_scale, **extras)
    return paged_attention_sdpa(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out,
                                k_scale=k_scale, v_scale=v_scale, **extras)


TORCH = AttentionBackend("torch", _paged_attention_torch, reshape_and_cache_ref, copy_blocks_ref, swap_blocks)


class TritonMissing(ImportError):
    """The triton backend was asked for where Triton is not installed (the CPU image)."""


def triton_backend() -> AttentionBackend:
    """The Triton kernels as a backend; ``TritonMissing`` where Triton is not installed."""
    # Imported here, not at module level: the CPU serving path runs without Triton installed.
    try:
        from pagedserve.kernels.triton_attention import paged_attention
        from pagedserve.kernels.triton_cache import copy_blocks, reshape_and_cache
    except ModuleNotFoundError as e:
        if e.name != "triton" and not (e.name or "").startswith("triton."):
            raise
        raise TritonMissing("the triton attention backend needs Triton (`pip install triton`); "
                            "the torch backend serves CPU without it") from None
    return AttentionBackend("triton", paged_attention, reshape_and_cache, copy_blocks, swap_blocks)


def get_attention_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """``name`` is auto|torch|triton; ``device`` is where the KV pool lives."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}")
    device = torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TORCH
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        # Triton has no CPU backend: CPU tensors need the interpreter, which is
        # chosen when the kernels are decorated (import time).
        raise RuntimeError("the triton backend on CPU needs TRITON_INTERPRET=1 set before pagedserve.kernels "
                           "is imported (it is set automatically when CUDA is absent)")
    return triton_backend()
