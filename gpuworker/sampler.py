"""Batched sampling with per-request parameters and reproducible seeds.

Randomness is a pure function of (seed, position of the token being sampled,
vocabulary index): a counter-based hash gives each (row, token) a uniform
number, and the exponential race (argmax of logit/T - log(-log u), i.e.
Gumbel-max) turns them into a sample. So a seeded request draws the same
tokens whatever else is in the batch, on any device, and again after a
recompute preemption re-sends its tokens. Unseeded rows get a fresh key from
the worker's own generator each step.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.common.messages.types import SamplingParams

_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (Wellons) on int64 tensors holding uint32 values; products
    wrap in int64 but the low 32 bits, which the mask keeps, are exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def _mix32_int(x: int) -> int:
    x &= _M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def row_key(seed: int, position: int) -> int:
    """A 32-bit key for sampling the token at ``position`` of a seeded sequence."""
    seed &= (1 << 64) - 1
    k = _mix32_int(_mix32_int(seed & _M32) ^ _mix32_int((seed >> 32) + 0x9E3779B9))
    return _mix32_int(k ^ _mix32_int(position + 0x632BE5AB))


def uniform_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """float32 [rows, vocab] in (0, 1), a pure function of each row's key."""
    idx = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)
    h = _mix32(_mix32(idx[None, :] ^ keys[:, None]) ^ ((keys[:, None] * 0x2545F491) & _M32))
    # 24 bits are exact in float32, and +0.5 keeps u strictly inside (0, 1).
    return ((h >> 8).float() + 0.5) / float(1 << 24)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]]]


class Sampler:
    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def _key(self, params: SamplingParams, position: int) -> int:
        if params.seed is not None:
            return row_key(params.seed, position)
        return int(torch.randint(0, 1 << 32, (1,), generator=self.generator).item())

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> SamplerOutput:
        """``logits`` [rows, vocab] (any float dtype); ``positions[i]`` is the index
        in its sequence of the token row i samples (= current length)."""
        logits = logits.float()
        raw = logits
        rows, vocab = logits.shape
        device = logits.device
        greedy = torch.tensor([p.greedy for p in params], device=device)
        out = logits.argmax(dim=-1)
        if not bool(greedy.all()):
            temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=device)
            scaled = _apply_top_k_top_p_min_p(logits / temps[:, None], params)
            keys = torch.tensor([self._key(p, pos) for p, pos in zip(params, positions)], dtype=torch.int64)
            u = uniform_noise(keys.to(device), vocab)
            gumbel = -torch.log(-torch.log(u))
            sampled = (scaled + gumbel).argmax(dim=-1)
            out = torch.where(greedy, out, sampled)
        token_ids = out.tolist()
        logprobs: list[float | None] = [None] * rows
        tops: list[list[tuple[int, float]]] = [[] for _ in range(rows)]
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if want:
            lp = torch.log_softmax(raw[want], dim=-1)
            chosen = lp.gather(1, out[want].unsqueeze(1)).squeeze(1).tolist()
            k = max(params[i].logprobs or 0 for i in want)
            top_v, top_i = lp.topk(k, dim=-1) if k > 0 else (None, None)
            for j, i in enumerate(want):
                logprobs[i] = chosen[j]
                n = params[i].logprobs or 0
                if n and top_v is not None and top_i is not None:
                    tops[i] = list(zip(top_i[j, :n].tolist(), top_v[j, :n].tolist()))
        return SamplerOutput(token_ids, logprobs, tops)


def _apply_top_k_top_p_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k / nucleus / min-p set."""
    need_k = any(p.top_k > 0 for p in params)
    need_p = any(p.top_p < 1.0 for p in params)
    need_min_p = any(p.min_p > 0.0 for p in params)
    if not (need_k or need_p or need_min_p):
        return logits
    device, vocab = logits.device, logits.shape[-1]
    if need_min_p:
        min_p = torch.tensor([p.min_p for p in params], device=device)
        probs = torch.softmax(logits, dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p[:, None]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if need_k or need_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        if need_k:
            k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device).clamp(max=vocab)
            ranks = torch.arange(vocab, device=device)[None, :]
            sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None], float("-inf"))
        if need_p:
            top_p = torch.tensor([p.top_p for p in params], device=device)
            probs = torch.softmax(sorted_logits, dim=-1)
            before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
            sorted_logits = sorted_logits.masked_fill(before >= top_p[:, None], float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits
