"""Turning one step's schedule (over the worker's ``SeqState``s) into
the flat batch the forward reads (token ids, positions, attention metadata,
which rows sample, which rows give prompt logprobs)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.gpuworker.layers import AttentionMetadata
from pagedserve.gpuworker.seq_state import SeqState


@dataclass
class PromptLogprobPlan:
    """Prompt tokens at positions [start, start + len(targets)) are scored by
    the logits of flat rows ``rows`` (each token's previous position)."""

    seq_id: int
    start: int
    rows: list[int]
    targets: list[int]
    top_k: int


@dataclass
class Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[int]  # index into ``scheduled`` of sequences that sample
    sample_token_idx: torch.Tensor  # flat-token index of their last token
    prompt_logprobs: list[PromptLogprobPlan]
    decode_only: bool  # one token per sequence: a CUDA-graph candidate


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host to device. On CUDA through pinned memory (torch caches the pinned
    blocks), so ``non_blocking`` really overlaps: from pageable memory the
    copy is staged and waits for the host."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def prepare_batch(
    scheduled: list[tuple[SeqState, int]], block_size: int, max_model_len: int, device: torch.device
) -> Batch:
    """Validate the schedule against each sequence's state and build the batch.
    Block ids were checked against the pool when they arrived (``check_blocks``)."""
    bs = block_size
    input_ids: list[int] = []
    seq_lens, starts, tables, sample_rows, sample_idx = [], [], [], [], []
    num_groups = len(scheduled[0][0].group_tables) if scheduled else 0  # > 0: a hybrid KV cache
    group_tables: list[list[list[int]]] = [[] for _ in range(num_groups)]
    plans: list[PromptLogprobPlan] = []
    for row, (seq, n) in enumerate(scheduled):
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        if n < 1 or end > len(seq.token_ids):
            raise ValueError(f"seq {seq.seq_id}: {n} tokens scheduled from {start}, but it has {len(seq.token_ids)}")
        if end > max_model_len:
            raise ValueError(f"seq {seq.seq_id}: length {end} exceeds max_model_len {max_model_len}")
        if len(seq.block_ids) * bs < end:
            raise ValueError(f"seq {seq.seq_id}: {len(seq.block_ids)} blocks cannot hold {end} tokens")
        flat0 = len(input_ids)
        input_ids += seq.token_ids[start:end]
        seq_lens.append(end)
        starts.append(start)
        tables.append(seq.block_ids[: (end + bs - 1) // bs])
        for g in range(1, num_groups):
            t = seq.group_tables[g]
            if len(t) * bs < end:
                raise ValueError(f"seq {seq.seq_id}: {len(t)} blocks of KV cache group {g} cannot hold {end} tokens")
            group_tables[g].append(t[: (end + bs - 1) // bs])
        if end == len(seq.token_ids):
            sample_rows.append(row)
            sample_idx.append(len(input_ids) - 1)
        k = seq.params.prompt_logprobs
        if k is not None:
            # Prompt token t (t >= 1) is scored by the logits at t - 1; this step
            # computes positions [start, end), so it scores t in [start + 1, last].
            last = min(end, seq.num_prompt_tokens - 1)
            if last >= start + 1:
                plans.append(PromptLogprobPlan(
                    seq.seq_id, start + 1, list(range(flat0, flat0 + last - start)),
                    seq.token_ids[start + 1 : last + 1], k,
                ))
    meta, positions = attention_metadata(seq_lens, starts, tables, bs, device)
    if num_groups:  # each group's layers read their group's tables and slots
        meta.groups = [meta] + [attention_metadata(seq_lens, starts, group_tables[g], bs, device)[0]
                                for g in range(1, num_groups)]
    ids = to_device(torch.tensor(input_ids, dtype=torch.long), device)
    idx = to_device(torch.tensor(sample_idx, dtype=torch.long), device)
    return Batch(ids, positions, meta, sample_rows, idx, plans, decode_only=len(input_ids) == len(scheduled))


def attention_metadata(
    seq_lens: list[int], starts: list[int], tables: list[list[int]], block_size: int, device: torch.device
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Positions, slot mapping and padded block tables for a flat batch whose
    sequence i computes positions [starts[i], seq_lens[i])."""
    q_lens = [end - start for start, end in zip(starts, seq_lens)]
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)  # one copy, not one per row
    q_lens_t = torch.tensor(q_lens, dtype=torch.int64)
    row = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens_t)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int64)
    qsl[1:] = q_lens_t.cumsum(0)
    positions = torch.arange(int(qsl[-1])) - qsl[row] + torch.tensor(starts, dtype=torch.int64)[row]
    slots = table[row, positions // block_size].long() * block_size + positions % block_size
    meta = AttentionMetadata(
        slot_mapping=to_device(slots, device),
        block_tables=to_device(table, device),
        seq_lens=to_device(torch.tensor(seq_lens, dtype=torch.int32), device),
        query_start_loc=to_device(qsl.to(torch.int32), device),
        max_seq_len=max(seq_lens),
        max_query_len=max(q_lens),
    )
    return meta, to_device(positions, device)
