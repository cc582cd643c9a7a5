"""Seeded sampling drawn as vLLM 0.32's CPU build draws it, so that a seeded
request gives vLLM's tokens wherever the two engines' logits are equal.

vLLM keeps one ``torch.Generator("cpu").manual_seed(seed)`` per seeded request
(gpu_model_runner ``_update_states``, which the CPU runner inherits). At every
step that samples a token for the request, ``TopKTopPSampler.forward_cpu``
takes one ``torch.randint(0, 2**31, (1,), generator=gen)`` from it and hands
it to the ``fused_gumbel_argmax`` kernel, whose noise for token i is
SplitMix64: ``key = splitmix64(draw)``, ``bits = splitmix64(key + (i + 1) *
GAMMA) >> 11``, ``u = (bits + 0.5) / 2^53``, and the token is the first argmax
of ``float64(logit_i) - log(-log u)`` over the processed float32 logits
(temperature, min-p, top-k and top-p applied). The kernel prunes tokens
that cannot win; the result is the plain argmax below.

The generator is advanced once per sampled token and never for a prefill
chunk that samples nothing. vLLM keeps it across a recompute preemption;
here the worker drops a sequence on preemption, so a generator is rebuilt by
replaying one draw per output token the sequence already has: the same state.
"""
from __future__ import annotations

import torch

GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment
_M64 = (1 << 64) - 1


def _i64(x: int) -> int:
    """A uint64 constant as the int64 bit pattern torch stores."""
    x &= _M64
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 tensors holding uint64 bits (torch's >> is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def splitmix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 tensors; products wrap mod 2^64 as uint64 ones do."""
    z = (z ^ _shr(z, 30)) * _i64(0xBF58476D1CE4E5B9)
    z = (z ^ _shr(z, 27)) * _i64(0x94D049BB133111EB)
    return z ^ _shr(z, 31)


def gumbel_argmax(logits: torch.Tensor, draws: torch.Tensor) -> torch.Tensor:
    """``fused_gumbel_argmax``'s result: ``logits`` float32 [rows, vocab],
    ``draws`` int64 [rows] (each row's draw from its generator)."""
    rows, vocab = logits.shape
    dev = logits.device
    key = splitmix64(draws.to(device=dev, dtype=torch.int64))[:, None]
    i = torch.arange(1, vocab + 1, dtype=torch.int64, device=dev)[None, :]
    bits = _shr(splitmix64(key + i * _i64(GAMMA)), 11)
    u = (bits.double() + 0.5) * 2.0**-53
    # float64: a float32 sum would round the noise away from near-tied logits
    scores = logits.double() - torch.log(-torch.log(u))
    # bits = 2^53 - 1 rounds u to 1 (noise +inf): a masked token would score NaN and
    # win torch's argmax; the kernel never looks at a -inf logit
    return scores.masked_fill_(logits == float("-inf"), float("-inf")).argmax(dim=-1)


class SeededGenerators:
    """Per-sequence CPU generators, each with the number of draws taken."""

    def __init__(self) -> None:
        self._gens: dict[int, tuple[int, torch.Generator, int]] = {}  # seq_id -> (seed, generator, draws)

    def draw(self, seq_id: int, seed: int, num_output_tokens: int) -> int:
        """The draw for a sequence's next token: its ``num_output_tokens + 1``-th."""
        held = self._gens.get(seq_id)
        if held is None or held[0] != seed or held[2] > num_output_tokens:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(seed)
            held = (seed, gen, 0)
        seed, gen, done = held
        for _ in range(num_output_tokens - done):  # replay: resent after a preemption, or forked
            torch.randint(0, 2**31, (1,), generator=gen, dtype=torch.long)
        value = int(torch.randint(0, 2**31, (1,), generator=gen, dtype=torch.long).item())
        self._gens[seq_id] = (seed, gen, num_output_tokens + 1)
        return value

    def drop(self, seq_id: int) -> None:
        self._gens.pop(seq_id, None)

    def clear(self) -> None:
        self._gens.clear()

    def __len__(self) -> int:
        return len(self._gens)
