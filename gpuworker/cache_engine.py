"""The KV pools: per layer a K and a V tensor of
``[num_blocks, block_size, num_kv_heads, head_dim]`` on the device, and the
same shape in CPU swap space (pinned on CUDA). Swaps and copy-on-write copies
move whole blocks of every layer; on CUDA the swaps run on a side stream and
the compute stream waits for them, so the forward that needs the blocks is
ordered after them. ``dtype`` is the pool's: the model's, or an fp8 format
(``--kv-cache-dtype``, kernels/fp8.py), one byte an element, so the same
memory holds more blocks; swaps and copies move its bytes as they are."""
from __future__ import annotations

import torch

from pagedserve.kernels import AttentionBackend

KVCache = tuple[torch.Tensor, torch.Tensor]


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


class CacheEngine:
    def __init__(
        self,
        num_layers: int,
        num_gpu_blocks: int,
        num_cpu_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        backend: AttentionBackend,
    ) -> None:
        self.num_gpu_blocks, self.num_cpu_blocks, self.block_size = num_gpu_blocks, num_cpu_blocks, block_size
        self.device, self.backend = device, backend
        shape = (num_gpu_blocks, block_size, num_kv_heads, head_dim)
        # zeros, not empty: NaN garbage in never-written slots must not leak through masked reads.
        # Eager on CPU too: torch asks for huge pages, so zeroing 4 GiB up front takes 0.7 s here,
        # while lazily zeroed small pages faulted inside steps (275 ms spikes).
        self.gpu: list[KVCache] = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)
        ]
        pin = device.type == "cuda"
        cpu_shape = (num_cpu_blocks, *shape[1:])
        self.cpu: list[KVCache] = [
            (torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin), torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin))
            for _ in range(num_layers)
        ] if num_cpu_blocks > 0 else []

    def _check(self, pairs: list[tuple[int, int]], src_n: int, dst_n: int, what: str) -> None:
        for s, d in pairs:
            if not (0 <= s < src_n and 0 <= d < dst_n):
                raise ValueError(f"{what} ({s}, {d}) out of range (pools of {src_n} and {dst_n} blocks)")

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(gpu, cpu) pairs."""
        self._check(pairs, self.num_gpu_blocks, self.num_cpu_blocks, "swap_out")
        self._swap(pairs, self.gpu, self.cpu)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(cpu, gpu) pairs."""
        self._check(pairs, self.num_cpu_blocks, self.num_gpu_blocks, "swap_in")
        self._swap(pairs, self.cpu, self.gpu)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write (src, dst) pairs inside the device pool (stream-ordered
        before the forward, as every kernel on the compute stream is)."""
        self._check(pairs, self.num_gpu_blocks, self.num_gpu_blocks, "copy")
        if pairs:
            self.backend.copy_blocks(self.gpu, torch.tensor(pairs, dtype=torch.int64))

    def _swap(self, pairs: list[tuple[int, int]], src: list[KVCache], dst: list[KVCache]) -> None:
        if not pairs:
            return
        flat_src = [t for kv in src for t in kv]
        flat_dst = [t for kv in dst for t in kv]
        event = self.backend.swap_blocks(flat_src, flat_dst, torch.tensor(pairs, dtype=torch.int64))
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)
