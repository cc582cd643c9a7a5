"""``swap_blocks``: moves KV blocks between the GPU pool and the CPU swap space
(plain copies, asynchronous on a side CUDA stream). No Triton: the CPU path
uses it too, and the CPU image ships without Triton.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


_side_streams: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _side_streams:
        _side_streams[index] = torch.cuda.Stream(device=index)
    return _side_streams[index]


def _runs(mapping: torch.Tensor) -> list[tuple[int, int, int]]:
    """(src, dst, length) runs of consecutive rows, so contiguous block ranges
    move in one copy."""
    runs: list[tuple[int, int, int]] = []
    for s, d in mapping.tolist():
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def swap_blocks(
    src_pool: torch.Tensor | Sequence[torch.Tensor],
    dst_pool: torch.Tensor | Sequence[torch.Tensor],
    mapping: torch.Tensor,
) -> torch.cuda.Event | None:
    """``dst_pool[dst] = src_pool[src]`` for every (src, dst) row of
    ``mapping`` (int64 [n, 2], on the host). Pools are one tensor or matching
    sequences of tensors (all layers' K and V) on any devices.

    When a CUDA pool is involved the copies are queued non-blocking on a side
    stream that first waits for the current stream (so blocks written by the
    last forward are final), and a recorded event is returned. Before the next
    forward, call ``torch.cuda.current_stream().wait_event(event)``: a
    swapped-in block is then present, and a swapped-out GPU block is not
    overwritten before it has left. Call ``event.synchronize()`` before the
    host itself reads a swapped-out CPU block. Without CUDA the copies are done
    on return and ``None`` is returned. Pin the CPU pool for real overlap.
    """
    srcs = [src_pool] if isinstance(src_pool, torch.Tensor) else list(src_pool)
    dsts = [dst_pool] if isinstance(dst_pool, torch.Tensor) else list(dst_pool)
    if len(srcs) != len(dsts):
        raise ValueError(f"{len(srcs)} source pools for {len(dsts)} destination pools")
    runs = _runs(mapping.cpu()) if mapping.numel() else []
    cuda = next((t.device for t in srcs + dsts if t.is_cuda), None)
    if cuda is None:
        for src, dst in zip(srcs, dsts):
            for s, d, n in runs:
                dst[d:d + n].copy_(src[s:s + n])
        return None
    stream = _side_stream(cuda)
    stream.wait_stream(torch.cuda.current_stream(cuda))
    with torch.cuda.stream(stream):
        for src, dst in zip(srcs, dsts):
            for s, d, n in runs:
                dst[d:d + n].copy_(src[s:s + n], non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    return event
