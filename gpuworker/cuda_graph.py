"""CUDA graphs of the model forward for decode batches (one token per
sequence), one graph per padded batch size.

A decode step of a small model is mostly kernel-launch overhead; replaying a
captured graph launches the whole forward at once. Every graph reads static
input buffers (token ids, positions, slot mapping, block tables, sequence
lengths) that each step overwrites in place. A batch of n sequences runs the
graph of the smallest captured size >= n; the padding rows compute garbage
nobody reads: their slot is -1 (the cache write skips it) and their length 1
(attention reads one valid slot). The attention kernel's host-side bound is
fixed at capture to max_model_len (its split-KV layout is baked into the
graph; empty partitions exit at once).

Sampling and the LM head stay outside the graph (they read only the n real
rows). Graphs need the Triton backend (the torch reference syncs on the host)
and a single rank (collectives are not captured); ``ModelRunner`` decides.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch

from pagedserve.common.blocks import cdiv

from pagedserve.gpuworker.layers import AttentionMetadata

# Padded batch sizes: fine steps where batches are small, coarser above.
CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def capture_sizes(max_num_seqs: int) -> list[int]:
    sizes = [s for s in CAPTURE_SIZES if s <= max_num_seqs]
    if not sizes or sizes[-1] < min(max_num_seqs, CAPTURE_SIZES[-1]):
        sizes.append(min(max_num_seqs, CAPTURE_SIZES[-1]))
    return sizes


class DecodeGraphs:
    def __init__(
        self, forward: Forward, max_batch: int, max_model_len: int, block_size: int, device: torch.device,
        use_graphs: bool = True,
    ) -> None:
        """``use_graphs=False`` runs the same padded static-buffer forward
        eagerly (no capture): the padding logic, testable on CPU."""
        self.forward, self.device, self.max_model_len, self.use_graphs = forward, device, max_model_len, use_graphs
        self.sizes = capture_sizes(max_batch)
        n, width = self.sizes[-1], cdiv(max_model_len, block_size)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(n, width, dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _meta(self, n: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:n], block_tables=self.block_tables[:n], seq_lens=self.seq_lens[:n],
            query_start_loc=self.query_start_loc[: n + 1], max_seq_len=self.max_model_len, max_query_len=1,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest first, so smaller graphs reuse its memory pool."""
        if not self.use_graphs:
            return
        t0 = time.monotonic()
        pool = torch.cuda.graph_pool_handle()
        free0 = torch.cuda.mem_get_info(self.device)[0]
        for n in reversed(self.sizes):
            args = (self.input_ids[:n], self.positions[:n], self._meta(n))
            for _ in range(2):  # compile the Triton kernels and settle cuBLAS workspaces outside the capture
                self.forward(*args)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.forward(*args)
            self.graphs[n] = (graph, out)
        torch.cuda.synchronize(self.device)
        used = (free0 - torch.cuda.mem_get_info(self.device)[0]) / 2**20
        print(f"pagedserve gpuworker: captured {len(self.sizes)} decode CUDA graphs (batch 1..{self.max_batch}) "
              f"in {time.monotonic() - t0:.1f} s, {used:.0f} MiB", file=sys.stderr, flush=True)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The forward of a decode batch of n <= max_batch sequences: hidden [n, ...]."""
        n = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= n)
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.seq_lens[:n].copy_(meta.seq_lens)
        if size > n:  # padding rows: no cache write, one-slot attention
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].fill_(1)
        self.replays += 1
        if not self.use_graphs:
            return self.forward(self.input_ids[:size], self.positions[:size], self._meta(size))[:n]
        graph, out = self.graphs[size]
        graph.replay()
        return out[:n]
