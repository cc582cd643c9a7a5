"""Batched sampling with per-request parameters and reproducible seeds.

Every sampled row takes the exponential race: the argmax of logit/T - log(-log u),
i.e. Gumbel-max. Seeded rows draw u as vLLM 0.32's CPU build does (seeded.py:
a per-request torch generator and SplitMix64 noise), so a seeded request gives
vLLM's tokens where the logits are equal, whatever else is in the batch, and
again after a recompute preemption. Unseeded rows take the fast path: a
counter-based hash gives each (row, token) a uniform number from a fresh key
drawn from the worker's own generator each step.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pagedserve.common.messages.types import SamplingParams
from pagedserve.gpuworker.seeded import SeededGenerators, gumbel_argmax

_M32 = 0xFFFFFFFF
SAMPLING_EPS = 1e-5  # vLLM: a lower temperature is greedy (and draws nothing)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (Wellons) on int64 tensors holding uint32 values; products
    wrap in int64 but the low 32 bits, which the mask keeps, are exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def uniform_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float32 [rows, vocab] in (0, 1), a pure function of each row's key."""
    idx = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)
    h = _mix32(_mix32(idx[None, :] ^ keys[:, None]) ^ ((keys[:, None] * 0x2545F491) & _M32))
    # 24 bits are exact in float32 and +0.5 keeps u above 0, but the top value
    # (2^24 - 0.5) / 2^24 rounds to 1.0: u = 1 gives infinite noise, which wins
    # the argmax whatever the logit (even -inf: a masked token). Clamp below 1.
    return (((h >> 8).float() + 0.5) / float(1 << 24)).clamp_(max=1.0 - 2.0**-24)


class SampleRow(Protocol):
    """What the sampler needs of a sequence (the runner's SeqState has it)."""

    seq_id: int  # keys the seeded generator (a stale or shared id only costs a replay)
    params: SamplingParams
    token_ids: list[int]  # prompt + output so far; the sampled token goes at index len(token_ids)
    num_prompt_tokens: int


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]]]


class Sampler:
    """Per step: logits processors (min_tokens, logit_bias, penalties), then
    greedy rows take the argmax and the others temperature, min-p, top-k,
    top-p and a seeded Gumbel-max draw. Logprobs are those of the raw model
    logits (as vLLM returns them)."""

    def __init__(self, seed: int, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.eos_token_ids = eos_token_ids
        self.seeded = SeededGenerators()

    def drop(self, seq_id: int) -> None:
        """A finished (or preempted) sequence's generator goes; a resent one replays its draws."""
        self.seeded.drop(seq_id)

    def _key(self) -> int:
        return int(torch.randint(0, 1 << 32, (1,), generator=self.generator).item())

    def __call__(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> SamplerOutput:
        """``logits`` [len(rows), vocab], any float dtype."""
        raw = logits.float()
        params = [r.params for r in rows]
        device = raw.device
        logits = apply_penalties(self.process(raw, rows), rows)
        out = logits.argmax(dim=-1)
        rand = [i for i, p in enumerate(params) if p.temperature >= SAMPLING_EPS]  # vLLM's greedy cut
        if rand:  # noise only for the rows that sample
            sub = logits[rand] if len(rand) < len(params) else logits
            temps = torch.tensor([params[i].temperature for i in rand], device=device)
            scaled = _apply_top_k_top_p_min_p(sub / temps[:, None], [params[i] for i in rand])
            seeded = [j for j, i in enumerate(rand) if params[i].seed is not None]
            free = [j for j, i in enumerate(rand) if params[i].seed is None]
            sampled = torch.empty(len(rand), dtype=torch.long, device=device)
            if free:  # the fast path: one hash-noise tensor for the unseeded rows
                keys = torch.tensor([self._key() for _ in free], dtype=torch.int64, device=device)
                u = uniform_noise(keys, raw.shape[1])
                pick = scaled[free] if len(free) < len(rand) else scaled
                sampled[free] = (pick - torch.log(-torch.log(u))).argmax(dim=-1)
            if seeded:
                draws = torch.tensor([self._draw(rows[rand[j]]) for j in seeded], dtype=torch.int64)
                pick = scaled[seeded] if len(seeded) < len(rand) else scaled
                sampled[seeded] = gumbel_argmax(pick, draws)
            out[torch.tensor(rand, device=device)] = sampled
        return _logprobs(raw, out, params)

    def _draw(self, row: SampleRow) -> int:
        assert row.params.seed is not None
        return self.seeded.draw(row.seq_id, row.params.seed, len(row.token_ids) - row.num_prompt_tokens)

    def process(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
        """min_tokens (no EOS / stop id before it), logit_bias, and vLLM's
        allowed_token_ids and bad_words (the last token of a bad word is banned
        while the output ends with the tokens before it)."""
        masks: list[tuple[int, int]] = []
        biases: list[tuple[int, int, float]] = []
        allowed: list[tuple[int, tuple[int, ...]]] = []
        vocab = logits.shape[1]
        for i, r in enumerate(rows):
            p = r.params
            if p.min_tokens and len(r.token_ids) - r.num_prompt_tokens < p.min_tokens:
                stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))
                masks += [(i, t) for t in stops if 0 <= t < vocab]
            biases += [(i, t, b) for t, b in p.logit_bias.items() if 0 <= t < vocab]
            if p.allowed_token_ids is not None:
                allowed.append((i, p.allowed_token_ids))
            if p.bad_words_token_ids:
                masks += [(i, t) for t in banned_by_bad_words(p.bad_words_token_ids, r.token_ids[r.num_prompt_tokens:])
                          if 0 <= t < vocab]
        if not (masks or biases or allowed):
            return logits
        logits = logits.clone()
        dev = logits.device
        for i, ids in allowed:  # vLLM masks the others before logit_bias and the penalties
            keep = torch.full((vocab,), float("-inf"), dtype=logits.dtype, device=dev)
            idx = torch.tensor([t for t in ids if 0 <= t < vocab], dtype=torch.long, device=dev)
            keep[idx] = 0.0
            logits[i] += keep
        if biases:
            r_idx, t_idx, vals = zip(*biases)
            index = (torch.tensor(r_idx, device=dev), torch.tensor(t_idx, device=dev))
            logits.index_put_(index, torch.tensor(vals, dtype=logits.dtype, device=dev), accumulate=True)
        if masks:
            r_idx, t_idx = zip(*masks)
            logits[torch.tensor(r_idx, device=dev), torch.tensor(t_idx, device=dev)] = float("-inf")
        return logits


def banned_by_bad_words(words: tuple[tuple[int, ...], ...], output: list[int]) -> list[int]:
    """vLLM's _apply_bad_words_single_batch: the output tokens so far (not the prompt) against each word."""
    out = []
    for word in words:
        if len(word) > len(output) + 1:
            continue
        prefix = word[:-1]
        if not prefix or tuple(output[-len(prefix):]) == prefix:
            out.append(word[-1])
    return out


def apply_penalties(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """Repetition penalty over prompt and output tokens (divide positive logits,
    multiply negative ones, as in HF / vLLM); presence and frequency penalties
    over output tokens only (OpenAI semantics)."""
    need = [
        i for i, r in enumerate(rows)
        if r.params.repetition_penalty != 1.0 or r.params.presence_penalty or r.params.frequency_penalty
    ]
    if not need:
        return logits
    device, vocab = logits.device, logits.shape[1]
    sub = logits[need]
    out_counts = torch.zeros(len(need), vocab, device=device)
    seen = torch.zeros(len(need), vocab, dtype=torch.bool, device=device)
    for j, i in enumerate(need):
        r = rows[i]
        prompt = torch.tensor(r.token_ids[: r.num_prompt_tokens], dtype=torch.long, device=device)
        output = torch.tensor(r.token_ids[r.num_prompt_tokens:], dtype=torch.long, device=device)
        out_counts[j].index_add_(0, output, torch.ones(len(output), device=device))
        seen[j, prompt] = True
    seen |= out_counts > 0
    rep = torch.tensor([rows[i].params.repetition_penalty for i in need], device=device)[:, None]
    pres = torch.tensor([rows[i].params.presence_penalty for i in need], device=device)[:, None]
    freq = torch.tensor([rows[i].params.frequency_penalty for i in need], device=device)[:, None]
    penalized = torch.where(sub > 0, sub / rep, sub * rep)
    sub = torch.where(seen, penalized, sub)
    sub = sub - freq * out_counts - pres * (out_counts > 0).float()
    logits = logits.clone()
    logits[need] = sub
    return logits


def _logprobs(raw: torch.Tensor, out: torch.Tensor, params: list[SamplingParams]) -> SamplerOutput:
    rows = raw.shape[0]
    token_ids = out.tolist()
    logprobs: list[float | None] = [None] * rows
    tops: list[list[tuple[int, float]]] = [[] for _ in range(rows)]
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if want:
        lp = torch.log_softmax(raw[want], dim=-1)
        chosen = lp.gather(1, out[want].unsqueeze(1)).squeeze(1).tolist()
        k = min(max(params[i].logprobs or 0 for i in want), raw.shape[1])
        top_v, top_i = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].long())
        top_v, top_i = top_v.tolist(), top_i.tolist()
        for j, i in enumerate(want):
            logprobs[i] = chosen[j]
            n = params[i].logprobs or 0
            tops[i] = list(zip(top_i[j][:n], top_v[j][:n]))
    return SamplerOutput(token_ids, logprobs, tops)


def _apply_top_k_top_p_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's min-p / top-k / nucleus set, in
    vLLM 0.32's CPU order and arithmetic (MinPLogitsProcessor, then
    apply_top_k_top_p_pytorch), so seeded draws race over the same set: top-k
    keeps ties with the k-th logit, top-p drops the ascending prefix whose
    cumulative mass is <= 1 - p (never the top token)."""
    vocab = logits.shape[-1]
    need_k = any(0 < p.top_k < vocab for p in params)
    need_p = any(p.top_p < 1.0 for p in params)
    need_min_p = any(p.min_p > 0.0 for p in params)
    if not (need_k or need_p or need_min_p):
        return logits
    device, ninf = logits.device, float("-inf")
    if need_min_p:
        min_p = torch.tensor([p.min_p for p in params], device=device)
        probs = torch.softmax(logits, dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True).mul_(min_p[:, None])
        logits = logits.masked_fill(probs < threshold, ninf)
    k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], dtype=torch.long, device=device)
    if need_k and not need_p:  # vLLM's apply_top_k_only: no full sort
        no_k = k == vocab
        k = k.masked_fill(no_k, 1)
        kth = logits.topk(int(k.max()), dim=1).values.gather(1, (k - 1).unsqueeze(1))
        kth.masked_fill_(no_k.unsqueeze(1), ninf)
        return logits.masked_fill(logits < kth, ninf)
    if not need_p:
        return logits
    logits_sort, order = logits.sort(dim=-1, descending=False)
    if need_k:
        kth = logits_sort.gather(1, (vocab - k).unsqueeze(1))
        logits_sort.masked_fill_(logits_sort < kth, ninf)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    probs_sum = torch.cumsum(logits_sort.softmax(dim=-1), dim=-1)
    drop = probs_sum <= 1 - top_p.unsqueeze(dim=1)
    drop[:, -1] = False
    logits_sort.masked_fill_(drop, ninf)
    return logits.scatter(-1, order, logits_sort)
