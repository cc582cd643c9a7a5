"""ModelRunner driven in-process with ExecuteStep messages, checked against
transformers' forward and generate on the same seeded tiny checkpoints."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch
from models import make_tiny_model
from transformers import AutoModelForCausalLM

from pagedserve.common.config import EngineConfig
from pagedserve.common.messages.types import SamplingParams
from pagedserve.common.messages.worker import BlockDiff, ExecuteStep, NewSeq, ScheduledSeq, StepResult
from pagedserve.gpuworker.model_runner import ModelRunner

BS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, torch.nn.Module]:
    folder = make_tiny_model(tmp_path_factory.mktemp("models"), request.param, seed=0)
    return folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def make_runner(folder: str, **kw: object) -> ModelRunner:
    cfg = EngineConfig(model=folder, device="cpu", dtype="float32", block_size=BS, **{"num_gpu_blocks": 64, **kw})  # type: ignore[arg-type]
    runner = ModelRunner(cfg, keep_logits=True)
    runner.init()
    return runner


@torch.no_grad()
def hf_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    return model(torch.tensor([tokens])).logits[0].float()


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    err = (ours - ref).abs().max().item() / ref.abs().max().item()
    assert err < 1e-4, f"relative error {err:.2e}"


@dataclass
class Driver:
    """A minimal scheduler stand-in: hands out shuffled physical blocks, sends
    each sequence once, then only block diffs and token counts."""

    runner: ModelRunner
    free: list[int] = field(default_factory=list)
    tokens: dict[int, list[int]] = field(default_factory=dict)
    blocks: dict[int, list[int]] = field(default_factory=dict)
    computed: dict[int, int] = field(default_factory=dict)
    step_id: int = 0

    def __post_init__(self) -> None:
        self.free = list(range(self.runner.cache.num_gpu_blocks))
        random.Random(1).shuffle(self.free)  # non-contiguous block tables

    def _grow(self, seq_id: int, length: int) -> list[int]:
        """Append blocks so ``length`` tokens fit; returns the new ones."""
        need = (length + BS - 1) // BS - len(self.blocks[seq_id])
        new = [self.free.pop() for _ in range(max(0, need))]
        self.blocks[seq_id] += new
        return new

    def step(
        self,
        schedule: dict[int, int],
        new: dict[int, tuple[list[int], SamplingParams]] | None = None,
        num_prompt: dict[int, int] | None = None,  # a resent sequence's prompt length (recompute)
        finished: list[int] | None = None,
        **extra: object,
    ) -> StepResult:
        new_seqs, diffs = [], []
        for seq_id, (toks, params) in (new or {}).items():
            self.tokens[seq_id], self.blocks[seq_id], self.computed[seq_id] = list(toks), [], 0
            self._grow(seq_id, len(toks))
            new_seqs.append(NewSeq(seq_id, list(toks), 0, params, (num_prompt or {}).get(seq_id, len(toks))))
            diffs.append(BlockDiff(seq_id, 0, list(self.blocks[seq_id])))  # a new sequence's table, as the scheduler sends it
        for seq_id, n in schedule.items():
            if seq_id in (new or {}):
                continue
            start = len(self.blocks[seq_id])
            added = self._grow(seq_id, self.computed[seq_id] + n)
            if added:
                diffs.append(BlockDiff(seq_id, start, added))
        self.step_id += 1
        result = self.runner.execute(
            ExecuteStep(self.step_id, new_seqs, diffs, [ScheduledSeq(s, n) for s, n in schedule.items()], finished or [], **extra)  # type: ignore[arg-type]
        )
        for seq_id, n in schedule.items():
            self.computed[seq_id] += n
        for tok in result.sampled:
            self.tokens[tok.seq_id].append(tok.token_id)
        for seq_id in finished or []:
            self.free += self.blocks.pop(seq_id)
        return result


def prompts(n: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(length)] for length in lengths[:n]]


def check_chunks_and_decodes(runner: ModelRunner, hf: torch.nn.Module, lengths: list[int], chunk: int,
                             decodes: int, seed: int = 11) -> Driver:
    """The families' exactness scenario: sequence 0 prefilled whole, sequence 1
    in chunks of ``chunk`` beside it, sequence 2 joining at the second step,
    then ``decodes`` decodes of all three. Every sampled row's logits within
    1e-4 of transformers' on the same tokens, and each sequence's greedy ids
    equal to transformers' ``generate``."""
    d = Driver(runner)
    ps = prompts(3, lengths, seed=seed)

    def check() -> None:  # every row sampled in the step just run
        for i, logits in runner.last_logits.items():
            assert_logits_close(logits, hf_logits(hf, d.tokens[i][:-1])[-1])

    fed = min(chunk, lengths[1])
    d.step({0: lengths[0], 1: fed}, new={0: (ps[0], GREEDY), 1: (ps[1], GREEDY)})
    check()
    joined = False
    while fed < lengths[1] or not joined:  # seq 1's further chunks; seq 2 joins with the first
        n = min(chunk, lengths[1] - fed) or 1
        d.step({0: 1, 1: n, 2: 1 if joined else lengths[2]}, new=None if joined else {2: (ps[2], GREEDY)})
        fed, joined = fed + n, True
        check()
    for _ in range(decodes):
        d.step({i: 1 for i in range(3)})
        check()
    for i in range(3):
        n_new = len(d.tokens[i]) - len(ps[i])
        out = hf.generate(torch.tensor([ps[i]]), max_new_tokens=n_new, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert d.tokens[i] == out[0].tolist()
    return d


def test_batched_prefill_then_decode_matches_transformers(ckpt: tuple[str, torch.nn.Module]) -> None:
    folder, hf = ckpt
    runner = make_runner(folder)
    d = Driver(runner)
    ps = prompts(4, [5, 17, 9, 30])
    res = d.step({i: len(p) for i, p in enumerate(ps)}, new={i: (p, GREEDY) for i, p in enumerate(ps)})
    assert [t.seq_id for t in res.sampled] == [0, 1, 2, 3]
    for i, p in enumerate(ps):
        ref = hf_logits(hf, p)[-1]
        assert_logits_close(runner.last_logits[i], ref)
        assert d.tokens[i][-1] == int(ref.argmax())
    for _ in range(6):  # decodes; sequences cross block boundaries and get diffs
        d.step({i: 1 for i in range(4)})
        for i in range(4):
            assert_logits_close(runner.last_logits[i], hf_logits(hf, d.tokens[i][:-1])[-1])
    for i, p in enumerate(ps):
        out = hf.generate(torch.tensor([p]), max_new_tokens=7, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert d.tokens[i] == out[0].tolist()


def test_chunked_prefill_samples_only_at_the_end(ckpt: tuple[str, torch.nn.Module]) -> None:
    folder, hf = ckpt
    runner = make_runner(folder)
    d = Driver(runner)
    long, short = prompts(2, [37, 6], seed=2)
    res = d.step({1: 6}, new={1: (short, GREEDY)})
    assert [t.seq_id for t in res.sampled] == [1]
    # chunk 1 of the long prompt alongside a decode
    res = d.step({0: 16, 1: 1}, new={0: (long, GREEDY)})
    assert [t.seq_id for t in res.sampled] == [1] and len(d.tokens[0]) == 37
    res = d.step({1: 1, 0: 13})
    assert [t.seq_id for t in res.sampled] == [1]
    res = d.step({0: 8})
    assert [t.seq_id for t in res.sampled] == [0]
    assert_logits_close(runner.last_logits[0], hf_logits(hf, long)[-1])
    d.step({0: 1, 1: 1})
    assert_logits_close(runner.last_logits[0], hf_logits(hf, d.tokens[0][:-1])[-1])
    assert_logits_close(runner.last_logits[1], hf_logits(hf, d.tokens[1][:-1])[-1])


def test_prefix_cached_start_reads_shared_blocks(ckpt: tuple[str, torch.nn.Module]) -> None:
    folder, hf = ckpt
    runner = make_runner(folder)
    d = Driver(runner)
    (a,) = prompts(1, [24], seed=3)
    d.step({0: 24}, new={0: (a, GREEDY)})
    b = a[:16] + prompts(1, [7], seed=4)[0]
    shared = d.blocks[0][:2]  # the two full blocks of a's prompt
    own = d.free.pop()
    d.blocks[1], d.tokens[1], d.computed[1] = shared + [own], list(b), 16
    d.step_id += 1
    res = runner.execute(ExecuteStep(d.step_id, [NewSeq(1, b, 16, GREEDY, len(b))], [BlockDiff(1, 0, shared + [own])],
                                     [ScheduledSeq(1, 7)], []))
    assert [t.seq_id for t in res.sampled] == [1]
    assert_logits_close(runner.last_logits[1], hf_logits(hf, b)[-1])


def test_copy_on_write_fork_and_swap_round_trip(ckpt: tuple[str, torch.nn.Module]) -> None:
    folder, hf = ckpt
    runner = make_runner(folder, swap_space=0.001)
    assert runner.ready is not None and runner.ready.num_cpu_blocks > 8
    d = Driver(runner)
    (p,) = prompts(1, [13], seed=5)
    d.step({0: 13}, new={0: (p, GREEDY)})
    # Fork: seq 1 shares block 0 and gets a copy of the partly filled block 1,
    # then continues with a different token than seq 0.
    src = d.blocks[0][1]
    dst = d.free.pop()
    fork = p + [(d.tokens[0][-1] + 1) % 500]
    d.blocks[1], d.tokens[1], d.computed[1] = [d.blocks[0][0], dst], list(fork), 13
    d.step_id += 1
    runner.execute(ExecuteStep(d.step_id, [NewSeq(1, fork, 13, GREEDY, 13)], [BlockDiff(1, 0, d.blocks[1])], [ScheduledSeq(1, 1)], [],
                               copies=[(src, dst)]))
    d.computed[1] += 1
    d.tokens[1].append(int(runner.last_logits[1].argmax()))
    assert_logits_close(runner.last_logits[1], hf_logits(hf, fork)[-1])
    d.step({0: 1})
    assert_logits_close(runner.last_logits[0], hf_logits(hf, d.tokens[0][:-1])[-1])
    # Swap seq 0 out, clobber its device blocks, swap it into other blocks.
    old = list(d.blocks[0])
    cpu = list(range(3, 3 + len(old)))
    d.step({}, swap_out=list(zip(old, cpu)))
    for k, v in runner.cache.gpu:
        k[old] = 7.0
        v[old] = -7.0
    new = [d.free.pop() for _ in old]
    d.blocks[0] = new
    d.step_id += 1
    runner.execute(ExecuteStep(d.step_id, [], [BlockDiff(0, 0, new)], [ScheduledSeq(0, 1)], [], swap_in=list(zip(cpu, new))))
    d.computed[0] += 1
    assert_logits_close(runner.last_logits[0], hf_logits(hf, d.tokens[0])[-1])


def test_finished_state_is_dropped_and_errors_are_clear(ckpt: tuple[str, torch.nn.Module]) -> None:
    folder, _ = ckpt
    runner = make_runner(folder)
    d = Driver(runner)
    ps = prompts(2, [4, 4])
    d.step({0: 4, 1: 4}, new={0: (ps[0], GREEDY), 1: (ps[1], GREEDY)})
    d.step({1: 1}, finished=[0])
    assert set(runner.states.seqs) == {1}
    with pytest.raises(ValueError, match="unknown seq 0"):
        runner.execute(ExecuteStep(99, [], [], [ScheduledSeq(0, 1)], []))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        runner.execute(ExecuteStep(100, [NewSeq(5, [1, 10**6], 0, GREEDY, 2)], [BlockDiff(5, 0, [0])], [ScheduledSeq(5, 2)], []))
    with pytest.raises(ValueError, match="cannot hold"):
        runner.execute(ExecuteStep(101, [NewSeq(6, list(range(3, 3 + BS + 1)), 0, GREEDY, BS + 1)], [BlockDiff(6, 0, [9])],
                                   [ScheduledSeq(6, BS + 1)], []))
    runner.reset()
    assert runner.states.seqs == {}


def test_seeded_sampling_is_batch_and_preemption_independent(ckpt: tuple[str, torch.nn.Module]) -> None:
    folder, _ = ckpt
    runner = make_runner(folder)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    (p,) = prompts(1, [11], seed=6)

    def run(alone: bool) -> list[int]:
        runner.reset()
        d = Driver(runner)
        new = {0: (p, seeded)}
        if not alone:  # 15 neighbours with every kind of parameter, seeded or not
            kinds = [
                SamplingParams(temperature=1.3), GREEDY, SamplingParams(temperature=0.5, top_k=5, seed=99),
                SamplingParams(temperature=1.0, min_p=0.1), SamplingParams(temperature=0.7, top_p=0.5, seed=1234),
                SamplingParams(temperature=1.0, repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.3),
                SamplingParams(temperature=0.0, logit_bias={7: 5.0}, logprobs=3),
                SamplingParams(temperature=2.0, min_tokens=4, seed=5),
            ]
            others = prompts(15, [5, 19, 8, 3, 12, 7, 1, 22, 9, 4, 16, 6, 2, 10, 13], seed=7)
            new |= {i + 1: (o, kinds[i % len(kinds)]) for i, o in enumerate(others)}
        d.step({s: len(t) for s, (t, _) in new.items()}, new=new)
        for _ in range(7):
            d.step({s: 1 for s in new})
        return d.tokens[0][len(p):]

    alone = run(alone=True)
    assert alone == run(alone=False)
    assert len(set(alone)) > 1  # really sampled, not a constant
    # Recompute preemption: re-sent with 3 generated tokens (marked as output, as the scheduler
    # sends it), it continues identically: the worker replays the seeded generator's 3 draws.
    runner.reset()
    d = Driver(runner)
    d.step({0: 14}, new={0: (p + alone[:3], seeded)}, num_prompt={0: len(p)})
    for _ in range(4):
        d.step({0: 1})
    assert d.tokens[0][len(p):] == alone[:8]
    # A different seed gives a different continuation.
    runner.reset()
    d = Driver(runner)
    d.step({0: 11}, new={0: (p, SamplingParams(temperature=0.9, top_p=0.95, seed=4321))})
    for _ in range(7):
        d.step({0: 1})
    assert d.tokens[0][len(p):] != alone


def test_pool_sizing_from_kv_cache_memory(ckpt: tuple[str, torch.nn.Module]) -> None:
    folder, hf = ckpt
    cfg = hf.config
    runner = ModelRunner(EngineConfig(model=folder, block_size=16, kv_cache_memory=1 << 20))
    ready = runner.init()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_block = 2 * cfg.num_hidden_layers * 16 * cfg.num_key_value_heads * head_dim * 4
    assert ready.num_gpu_blocks == (1 << 20) // per_block
    assert runner.cache.gpu[0][0].shape == (ready.num_gpu_blocks, 16, cfg.num_key_value_heads, head_dim)
    assert ready.model.eos_token_ids == (0,) and ready.model.vocab_size == 509
    assert ready.model.max_model_len == 512


def test_triton_backend_matches_transformers(ckpt: tuple[str, torch.nn.Module]) -> None:
    """The Triton kernels (interpreted on CPU) in the real forward: small on purpose."""
    folder, hf = ckpt
    runner = make_runner(folder, attention_backend="triton", num_gpu_blocks=16)
    assert runner.backend.name == "triton"
    d = Driver(runner)
    ps = prompts(2, [11, 4], seed=8)
    d.step({0: 11, 1: 4}, new={0: (ps[0], GREEDY), 1: (ps[1], GREEDY)})
    d.step({0: 1, 1: 1})
    for i in range(2):
        assert_logits_close(runner.last_logits[i], hf_logits(hf, d.tokens[i][:-1])[-1])


def test_prompt_logprobs_and_sampled_logprobs_match_transformers(ckpt: tuple[str, torch.nn.Module]) -> None:
    """Prompt logprobs across a chunked prefill (and after a prefix-cache
    start), sampled-token logprobs and their top-k: log_softmax of
    transformers' logits within 1e-4, same top-k ids."""
    folder, hf = ckpt
    runner = make_runner(folder)
    d = Driver(runner)
    a, b = prompts(2, [20, 6], seed=12)
    scored = SamplingParams(temperature=0.0, prompt_logprobs=3, logprobs=4)
    sampled = SamplingParams(temperature=1.2, seed=3, logprobs=2, prompt_logprobs=0)
    results = [d.step({0: 7, 1: 6}, new={0: (a, scored), 1: (b, sampled)})]
    results.append(d.step({0: 13, 1: 1}))
    for _ in range(2):
        results.append(d.step({0: 1, 1: 1}))
    ref = {i: torch.log_softmax(hf_logits(hf, d.tokens[i]), dim=-1) for i in (0, 1)}

    def check_top(got: list[tuple[int, float]], lp: torch.Tensor, k: int) -> None:
        v, i = lp.topk(k)
        assert [t for t, _ in got] == i.tolist()
        assert all(abs(x - y) < 1e-4 for (_, x), y in zip(got, v.tolist()))

    for seq_id, k, n_prompt in ((0, 3, 20), (1, 0, 6)):
        entries = [(p.start + j, e) for r in results for p in r.prompt_logprobs if p.seq_id == seq_id
                   for j, e in enumerate(p.entries)]
        assert [pos for pos, _ in entries] == list(range(1, n_prompt))  # every prompt token but the first, once
        for pos, (logprob, top) in entries:
            lp = ref[seq_id][pos - 1]
            assert abs(logprob - float(lp[d.tokens[seq_id][pos]])) < 1e-4
            assert len(top) == k
            check_top(top, lp, k)
        outs = [t for r in results for t in r.sampled if t.seq_id == seq_id]
        assert len(outs) == len(d.tokens[seq_id]) - n_prompt
        for j, t in enumerate(outs):  # output token j sits at position n_prompt + j
            lp = ref[seq_id][n_prompt + j - 1]
            assert abs(t.logprob - float(lp[t.token_id])) < 1e-4  # raw-logit logprob, whatever the temperature
            check_top(t.top_logprobs, lp, 4 if seq_id == 0 else 2)
    # A prefix-cache start scores only the positions it computes.
    runner.reset()
    d = Driver(runner)
    d.step({0: 16}, new={0: (a[:16], GREEDY)})
    shared = d.blocks[0][:2]
    d.step_id += 1
    res = runner.execute(ExecuteStep(d.step_id, [NewSeq(1, a, 16, scored, 20)], [BlockDiff(1, 0, shared + [d.free.pop()])],
                                     [ScheduledSeq(1, 4)], []))
    (p,) = res.prompt_logprobs
    assert p.start == 17 and len(p.entries) == 3
    for j, (logprob, _) in enumerate(p.entries):
        assert abs(logprob - float(ref[0][16 + j][a[17 + j]])) < 1e-4


def test_cuda_graphs_fall_back_to_eager_on_cpu(ckpt: tuple[str, torch.nn.Module]) -> None:
    folder, hf = ckpt
    runner = ModelRunner(EngineConfig(model=folder, device="cpu", dtype="float32", block_size=BS, num_gpu_blocks=16),
                         cuda_graphs=True, keep_logits=True)
    runner.init()
    assert runner.graphs is None
    d = Driver(runner)
    d.step({0: 4}, new={0: ([5, 6, 7, 8], GREEDY)})
    d.step({0: 1})
    assert_logits_close(runner.last_logits[0], hf_logits(hf, d.tokens[0][:-1])[-1])


def test_padded_decode_buffers_match_the_plain_forward(ckpt: tuple[str, torch.nn.Module]) -> None:
    """What a CUDA graph replays, run eagerly on CPU with the Triton kernels
    (interpreted): static buffers, padding rows (slot -1, length 1) and the
    attention bound fixed at max_model_len (split-KV with empty partitions)."""
    from pagedserve.gpuworker.cuda_graph import DecodeGraphs

    folder, _ = ckpt
    padded = make_runner(folder, attention_backend="triton", num_gpu_blocks=24)
    plain = make_runner(folder, attention_backend="triton", num_gpu_blocks=24)
    padded.graphs = DecodeGraphs(padded._forward, 4, padded.max_model_len, BS, padded.device, use_graphs=False)
    assert padded.graphs.sizes == [1, 2, 4]
    drivers = [Driver(padded), Driver(plain)]
    ps = prompts(3, [13, 4, 7], seed=14)
    for d in drivers:
        d.step({i: len(p) for i, p in enumerate(ps)}, new={i: (p, GREEDY) for i, p in enumerate(ps)})
    for schedule in ({0: 1, 1: 1, 2: 1}, {0: 1, 2: 1}, {2: 1}):  # padded to 4, then 2, then 1
        for d in drivers:
            d.step(schedule)
        for s in schedule:
            assert_logits_close(padded.last_logits[s], plain.last_logits[s])
    assert padded.graphs.replays == 3 and drivers[0].tokens == drivers[1].tokens
