"""The worker's core, with no sockets: it owns the model, the KV pools and each
sequence's state, and turns one ``ExecuteStep`` into one ``StepResult``.

State is incremental (vLLM v1 style): a sequence arrives once as ``NewSeq``;
afterwards the scheduler sends only block-table diffs and how many tokens to
compute. The runner appends every token it samples, so it always knows the
whole sequence; it samples only when the scheduled tokens reach its end.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass

import torch

from pagedserve.common.config import EngineConfig
from pagedserve.common.default_model import resolve_model
from pagedserve.common.messages.types import ModelInfo, SamplingParams
from pagedserve.common.messages.worker import ExecuteStep, NewSeq, SampledToken, StepResult, WorkerReady
from pagedserve.gpuworker.cache_engine import CacheEngine, bytes_per_block
from pagedserve.gpuworker.layers import AttentionMetadata, PagedAttention
from pagedserve.kernels import get_attention_backend
from pagedserve.gpuworker.loader import eos_token_ids, iter_weights, load_hf_config
from pagedserve.gpuworker.models import build_model
from pagedserve.gpuworker.sampler import Sampler

CPU_DEFAULT_KV_BYTES = 256 << 20
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class SeqState:
    seq_id: int
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    params: SamplingParams
    num_prompt_tokens: int


@dataclass
class Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[int]  # index into ``scheduled`` of sequences that sample
    sample_token_idx: torch.Tensor  # flat-token index of their last token


class ModelRunner:
    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.dtype = _DTYPES[cfg.torch_dtype_name]
        self.seqs: dict[int, SeqState] = {}
        self.last_logits: dict[int, torch.Tensor] = {}  # seq_id -> float32 [vocab], for tests
        self.ready: WorkerReady | None = None

    # ---- start-up -------------------------------------------------------
    def init(self) -> WorkerReady:
        """Load the model, size and allocate the KV pools (idempotent)."""
        if self.ready is not None:
            return self.ready
        cfg = self.cfg
        folder = resolve_model(cfg.model)
        hf = load_hf_config(folder)
        self.hf_config = hf
        model_max = int(getattr(hf, "max_position_embeddings", 0) or 0) or 2048
        window = getattr(hf, "sliding_window", None) if getattr(hf, "model_type", "") == "mistral" else None
        limit = min(model_max, window) if window else model_max
        if cfg.max_model_len is not None and cfg.max_model_len > limit:
            why = f"sliding window {window}" if window and window < model_max else f"max_position_embeddings {model_max}"
            raise ValueError(f"max_model_len {cfg.max_model_len} exceeds the model's {why}")
        self.max_model_len = cfg.max_model_len or limit
        t0 = time.monotonic()
        self.model = build_model(hf, iter_weights(folder), self.dtype, self.device, max(model_max, self.max_model_len))
        load_s = time.monotonic() - t0
        self.backend = get_attention_backend(cfg.attention_backend, self.device)
        for m in self.model.modules():
            if isinstance(m, PagedAttention):
                m.backend = self.backend
        self.num_layers = self.model.num_layers
        self.num_kv_heads, self.head_dim = self.model.num_kv_heads, self.model.head_dim
        self.vocab_size = hf.vocab_size
        eos = eos_token_ids(folder, hf)
        self.sampler = Sampler(cfg.seed, eos)  # before sizing: the CUDA profile runs it
        per_block = bytes_per_block(self.num_layers, cfg.block_size, self.num_kv_heads, self.head_dim, self.dtype)
        num_gpu_blocks = self._num_gpu_blocks(per_block)
        num_cpu_blocks = int(cfg.swap_space * (1 << 30)) // per_block
        self.cache = CacheEngine(
            self.num_layers, num_gpu_blocks, num_cpu_blocks, cfg.block_size,
            self.num_kv_heads, self.head_dim, self.dtype, self.device, self.backend,
        )
        name = "SmolLM2-135M-Instruct" if cfg.model is None else os.path.basename(os.path.normpath(folder))
        info = ModelInfo(
            model_name=name, vocab_size=self.vocab_size, max_model_len=self.max_model_len, eos_token_ids=eos,
            num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            dtype=cfg.torch_dtype_name, device=str(self.device),
        )
        print(
            f"pagedserve gpuworker: {name} ({type(self.model).__name__}, {cfg.torch_dtype_name}, {self.device}, "
            f"attention={self.backend.name}) loaded in {load_s:.1f} s; KV pool {num_gpu_blocks} blocks x {cfg.block_size} = "
            f"{num_gpu_blocks * cfg.block_size} tokens ({num_gpu_blocks * per_block / 2**20:.0f} MiB), "
            f"swap {num_cpu_blocks} blocks",
            file=sys.stderr, flush=True,
        )
        self.ready = WorkerReady(model=info, num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks, block_size=cfg.block_size)
        return self.ready

    def _num_gpu_blocks(self, per_block: int) -> int:
        cfg = self.cfg
        if cfg.num_gpu_blocks is not None:
            return cfg.num_gpu_blocks
        if cfg.kv_cache_memory is not None:
            n = cfg.kv_cache_memory // per_block
        elif self.device.type == "cuda":
            n = self._profile_free_bytes() // per_block
        else:
            n = CPU_DEFAULT_KV_BYTES // per_block
        if n < 2:
            raise ValueError(f"KV cache memory too small: {n} blocks of {per_block} bytes")
        return int(n)

    @torch.inference_mode()
    def _profile_free_bytes(self) -> int:
        """Run a forward of max_num_batched_tokens (and sampling-sized logits) to
        find the activation peak, then give gpu_memory_utilization of the
        device, minus weights, activations and non-torch memory, to the pool."""
        cfg, dev = self.cfg, self.device
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        free0, total = torch.cuda.mem_get_info(dev)
        non_torch = (total - free0) - torch.cuda.memory_reserved(dev)
        n_tok = min(cfg.max_num_batched_tokens, cfg.max_num_seqs * self.max_model_len)
        seq_len = min(n_tok, self.max_model_len)
        n_seqs = (n_tok + seq_len - 1) // seq_len
        blocks_per_seq = (seq_len + cfg.block_size - 1) // cfg.block_size
        scratch = CacheEngine(
            self.num_layers, n_seqs * blocks_per_seq, 0, cfg.block_size, self.num_kv_heads, self.head_dim, self.dtype, dev, self.backend
        )
        lens = [seq_len] * (n_tok // seq_len) + ([n_tok % seq_len] if n_tok % seq_len else [])
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(len(lens))]
        meta, positions = _metadata(lens, [0] * len(lens), tables, cfg.block_size, self.device)
        ids = torch.zeros(n_tok, dtype=torch.long, device=dev)
        hidden = self.model(ids, positions, scratch.gpu, meta)
        logits = self.model.compute_logits(hidden[: min(cfg.max_num_seqs, n_tok)])
        dummy = SeqState(0, [0], [], 0, SamplingParams(temperature=1.0, top_p=0.9, repetition_penalty=1.1), 1)
        self.sampler(logits, [dummy] * logits.shape[0])
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        del scratch, hidden, logits
        torch.cuda.empty_cache()
        return max(0, int(total * cfg.gpu_memory_utilization) - peak - non_torch)

    # ---- steps ----------------------------------------------------------
    def reset(self) -> None:
        self.seqs.clear()
        self.last_logits.clear()

    @torch.inference_mode()
    def execute(self, step: ExecuteStep) -> StepResult:
        if self.ready is None:
            raise RuntimeError("worker not initialised (send InitWorker first)")
        t0 = time.perf_counter()
        for seq_id in step.finished:
            self.seqs.pop(seq_id, None)
        for new in step.new_seqs:
            self._add(new)
        for diff in step.block_diffs:
            seq = self._seq(diff.seq_id)
            if diff.table_start > len(seq.block_ids):
                raise ValueError(f"seq {diff.seq_id}: block diff starts at {diff.table_start} past its table of {len(seq.block_ids)}")
            del seq.block_ids[diff.table_start:]
            seq.block_ids.extend(diff.block_ids)
        # Swap out first: the blocks it frees may be the destinations of swap-ins.
        self.cache.swap_out(step.swap_out)
        self.cache.swap_in(step.swap_in)
        self.cache.copy(step.copies)
        self.last_logits.clear()
        if not step.scheduled:
            return StepResult(step.step_id, [], time.perf_counter() - t0)
        scheduled = [(self._seq(s.seq_id), s.num_tokens) for s in step.scheduled]
        batch = self._prepare(scheduled)
        hidden = self.model(batch.input_ids, batch.positions, self.cache.gpu, batch.meta)
        sampled: list[SampledToken] = []
        if batch.sample_rows:
            logits = self.model.compute_logits(hidden[batch.sample_token_idx]).float()
            seqs = [scheduled[r][0] for r in batch.sample_rows]
            out = self.sampler(logits, seqs)
            for i, seq in enumerate(seqs):
                self.last_logits[seq.seq_id] = logits[i]
                sampled.append(SampledToken(seq.seq_id, out.token_ids[i], out.logprobs[i], out.top_logprobs[i]))
        for seq, n in scheduled:
            seq.num_computed_tokens += n
        for tok in sampled:
            self.seqs[tok.seq_id].token_ids.append(tok.token_id)
        return StepResult(step.step_id, sampled, time.perf_counter() - t0)

    def _add(self, new: NewSeq) -> None:
        if not new.token_ids:
            raise ValueError(f"seq {new.seq_id}: empty token_ids")
        if not 0 <= new.num_computed_tokens < len(new.token_ids):
            raise ValueError(f"seq {new.seq_id}: num_computed_tokens {new.num_computed_tokens} outside [0, {len(new.token_ids)})")
        bad = [t for t in new.token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"seq {new.seq_id}: token ids outside the vocabulary of {self.vocab_size}: {bad[:5]}")
        # A re-sent seq (recompute preemption) replaces the old state.
        self.seqs[new.seq_id] = SeqState(
            new.seq_id, list(new.token_ids), list(new.block_ids), new.num_computed_tokens, new.params, new.num_prompt_tokens
        )

    def _seq(self, seq_id: int) -> SeqState:
        try:
            return self.seqs[seq_id]
        except KeyError:
            raise ValueError(f"unknown seq {seq_id} (never sent as NewSeq, or already finished)") from None

    def _prepare(self, scheduled: list[tuple[SeqState, int]]) -> Batch:
        bs = self.cfg.block_size
        input_ids: list[int] = []
        seq_lens, starts, tables, sample_rows, sample_idx = [], [], [], [], []
        for row, (seq, n) in enumerate(scheduled):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            if n < 1 or end > len(seq.token_ids):
                raise ValueError(f"seq {seq.seq_id}: {n} tokens scheduled from {start}, but it has {len(seq.token_ids)}")
            if end > self.max_model_len:
                raise ValueError(f"seq {seq.seq_id}: length {end} exceeds max_model_len {self.max_model_len}")
            if len(seq.block_ids) * bs < end:
                raise ValueError(f"seq {seq.seq_id}: {len(seq.block_ids)} blocks cannot hold {end} tokens")
            if any(not 0 <= b < self.cache.num_gpu_blocks for b in seq.block_ids[: (end + bs - 1) // bs]):
                raise ValueError(f"seq {seq.seq_id}: block id outside the pool of {self.cache.num_gpu_blocks}")
            input_ids += seq.token_ids[start:end]
            seq_lens.append(end)
            starts.append(start)
            tables.append(seq.block_ids[: (end + bs - 1) // bs])
            if end == len(seq.token_ids):
                sample_rows.append(row)
                sample_idx.append(len(input_ids) - 1)
        meta, positions = _metadata(seq_lens, starts, tables, bs, self.device)
        ids = torch.tensor(input_ids, dtype=torch.long).to(self.device, non_blocking=True)
        idx = torch.tensor(sample_idx, dtype=torch.long).to(self.device, non_blocking=True)
        return Batch(ids, positions, meta, sample_rows, idx)


def _metadata(
    seq_lens: list[int], starts: list[int], tables: list[list[int]], block_size: int, device: torch.device
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Positions, slot mapping and padded block tables for a flat batch whose
    sequence i computes positions [starts[i], seq_lens[i])."""
    q_lens = [end - start for start, end in zip(starts, seq_lens)]
    width = max(len(t) for t in tables)
    table = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    q_lens_t = torch.tensor(q_lens, dtype=torch.int64)
    row = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens_t)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int64)
    qsl[1:] = q_lens_t.cumsum(0)
    positions = torch.arange(int(qsl[-1])) - qsl[row] + torch.tensor(starts, dtype=torch.int64)[row]
    slots = table[row, positions // block_size].long() * block_size + positions % block_size
    meta = AttentionMetadata(
        slot_mapping=slots.to(device, non_blocking=True),
        block_tables=table.to(device, non_blocking=True),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device, non_blocking=True),
        query_start_loc=qsl.to(torch.int32).to(device, non_blocking=True),
        max_seq_len=max(seq_lens),
        max_query_len=max(q_lens),
    )
    return meta, positions.to(device, non_blocking=True)
