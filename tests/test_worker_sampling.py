"""The sampler against analytic distributions and straightforward references."""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from pagedserve.common.messages.types import SamplingParams
from pagedserve.gpuworker.sampler import Sampler, apply_penalties, uniform_noise

LOGITS = [2.0, 1.0, 0.5, 0.0, -1.0, -3.0]
# chi-square critical values at p = 0.001 by degrees of freedom
CHI2_CRIT = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


@dataclass
class Row:
    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    seq_id: int = 0


def expected(params: SamplingParams) -> list[float]:
    """The distribution the parameters define, computed directly in float64."""
    z = [x / params.temperature for x in LOGITS]
    p = [math.exp(x - max(z)) for x in z]
    p = [x / sum(p) for x in p]
    keep = [True] * len(p)
    if params.min_p > 0:
        keep = [k and x >= params.min_p * max(p) for k, x in zip(keep, p)]
    order = sorted(range(len(p)), key=lambda i: -p[i])
    if params.top_k > 0:
        for rank, i in enumerate(order):
            keep[i] = keep[i] and rank < params.top_k
    if params.top_p < 1.0:
        kept = [i for i in order if keep[i]]
        total = sum(p[i] for i in kept)
        mass = 0.0
        for i in kept:
            keep[i] = mass < params.top_p
            mass += p[i] / total
    q = [x if k else 0.0 for x, k in zip(p, keep)]
    return [x / sum(q) for x in q]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=1.5, top_k=3),
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.2),
        SamplingParams(temperature=0.8, top_k=4, top_p=0.9),
    ],
    ids=["t1", "t0.5", "topk", "topp", "minp", "topk+topp"],
)
def test_seeded_samples_follow_the_analytic_distribution(params: SamplingParams) -> None:
    n = 6000
    rows = [Row(SamplingParams(**{**_fields(params), "seed": s}), [0], 1) for s in range(n)]
    out = Sampler(0)(torch.tensor([LOGITS] * n), rows).token_ids
    probs = expected(params)
    counts = [out.count(i) for i in range(len(LOGITS))]
    assert all(c == 0 for c, p in zip(counts, probs) if p == 0.0), (counts, probs)
    support = [(c, p) for c, p in zip(counts, probs) if p > 0]
    chi2 = sum((c - n * p) ** 2 / (n * p) for c, p in support)
    assert chi2 < CHI2_CRIT[len(support) - 1], (chi2, counts, [round(n * p) for p in probs])


def _fields(p: SamplingParams) -> dict[str, object]:
    return {f: getattr(p, f) for f in p.__struct_fields__}


def test_unseeded_rows_draw_fresh_noise_and_uniform_noise_is_pure() -> None:
    sampler = Sampler(0)
    rows = [Row(SamplingParams(temperature=1.0), [0], 1)] * 400
    assert len(set(sampler(torch.zeros(400, 50), rows).token_ids)) > 20
    assert len(sampler.seeded) == 0  # the fast path keeps no generator
    keys = torch.tensor([0x1234ABCD, 0x0BADF00D])
    u = uniform_noise(keys, 1000)
    assert torch.equal(u[0], uniform_noise(keys[:1], 1000)[0])
    assert 0.0 < float(u.min()) and float(u.max()) < 1.0 and abs(float(u.mean()) - 0.5) < 0.02


def test_penalties_match_a_straightforward_reference() -> None:
    torch.manual_seed(0)
    vocab = 40
    logits = torch.randn(4, vocab) * 3
    rows = [
        Row(SamplingParams(repetition_penalty=1.3), [1, 2, 3, 5, 5, 9], 3),
        Row(SamplingParams(presence_penalty=0.7, frequency_penalty=0.4), [4, 4, 6, 6, 6, 7], 2),
        Row(SamplingParams(), [1, 2, 3], 2),
        Row(SamplingParams(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=1.0), [8, 1, 1, 8, 30], 1),
    ]
    ref = logits.clone()
    for i, r in enumerate(rows):
        p = r.params
        output = r.token_ids[r.num_prompt_tokens:]
        for t in set(r.token_ids):
            x = ref[i, t]
            ref[i, t] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for t in set(output):
            ref[i, t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    torch.testing.assert_close(apply_penalties(logits, rows), ref)


def test_logit_bias_min_tokens_and_logprobs() -> None:
    eos = 3
    logits = torch.tensor([[0.0, 1.0, 2.0, 5.0, 0.5]] * 4)
    rows = [
        Row(SamplingParams(temperature=0.0, logit_bias={0: 10.0}), [1], 1),
        Row(SamplingParams(temperature=0.0, min_tokens=2), [1, 2], 1),  # 1 output < 2: no EOS yet
        Row(SamplingParams(temperature=0.0, min_tokens=2), [1, 2, 2], 1),  # 2 outputs: EOS allowed
        Row(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(2,), logprobs=3), [1], 1),
    ]
    out = Sampler(0, eos_token_ids=(eos,))(logits, rows)
    assert out.token_ids == [0, 2, 3, 1]
    lp = torch.log_softmax(logits[3], dim=-1)
    assert out.logprobs[:3] == [None, None, None]
    assert out.logprobs[3] == pytest.approx(float(lp[1]), abs=1e-5)  # raw logits' logprob
    assert [t for t, _ in out.top_logprobs[3]] == [3, 2, 1]
    assert [v for _, v in out.top_logprobs[3]] == pytest.approx(lp[[3, 2, 1]].tolist(), abs=1e-5)
