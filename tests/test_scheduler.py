"""The pure scheduler, driven in-process with the real BlockManager and the
SIMULATED worker, whose slot-level pool checks every block table it is sent."""
from __future__ import annotations

import random

import pytest

from pagedserve.blockmgr.manager import BlockManager
from pagedserve.common.config import EngineConfig
from pagedserve.common.messages import worker as wk
from pagedserve.common.messages.frontend import AbortRequest, AddRequest, ErrorKind, TokenDelta
from pagedserve.common.messages.types import SamplingParams
from pagedserve.gpuworker.sim_worker import SimWorker, expected_output
from pagedserve.scheduler.engine import EngineCore, InProcessBlockClient, InProcessWorkerClient

VOCAB = 500


class RecordingWorker(InProcessWorkerClient):
    """Keeps every ExecuteStep so tests can check what each step ran."""

    def __init__(self, runner: SimWorker) -> None:
        super().__init__(runner)
        self.steps: list[wk.ExecuteStep] = []

    def call(self, req: wk.Request, timeout_s: float | None = None) -> wk.Reply:
        if isinstance(req, wk.ExecuteStep):
            self.steps.append(req)
        return super().call(req, timeout_s)


def make_engine(num_gpu_blocks: int, block_size: int = 4, num_cpu_blocks: int = 0, mode: str = "recompute",
                max_num_seqs: int = 64, budget: int = 256, prefix_caching: bool = True,
                async_scheduling: bool = False,
                ) -> tuple[EngineCore, RecordingWorker, InProcessBlockClient]:
    # Synchronous unless asked: these tests read each step's ExecuteStep right after it.
    cfg = EngineConfig(block_size=8 if block_size == 4 else block_size, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=budget, preemption_mode=mode, enable_prefix_caching=prefix_caching,
                       async_scheduling="on" if async_scheduling else "off")
    worker = RecordingWorker(SimWorker(num_gpu_blocks, block_size, num_cpu_blocks, VOCAB, max_model_len=4096))
    blocks = InProcessBlockClient(lambda init: BlockManager(init.num_gpu_blocks, init.num_cpu_blocks,
                                                            init.block_size, init.enable_prefix_caching,
                                                            init.watermark))
    return EngineCore(cfg, blocks, worker), worker, blocks


def add(core: EngineCore, rid: str, prompt: list[int], max_tokens: int, t: float = 0.0) -> None:
    core.handle(AddRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), t))


def collect(deltas: list[TokenDelta]) -> dict[str, tuple[list[int], str | None]]:
    out: dict[str, tuple[list[int], str | None]] = {}
    for d in deltas:
        toks, _ = out.get(d.request_id, ([], None))
        out[d.request_id] = (toks + d.token_ids, d.finish_reason)
    return out


def assert_all_free(core: EngineCore, blocks: InProcessBlockClient) -> None:
    core.step()  # flushes the last frees
    blocks.manager.check_integrity()
    s = blocks.manager.stats()
    assert s.num_free_gpu_blocks == s.num_gpu_blocks
    assert s.num_free_cpu_blocks == s.num_cpu_blocks
    assert s.num_seqs == 0


def random_prompts(n: int, rng: random.Random, lo: int = 3, hi: int = 40) -> list[list[int]]:
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_fcfs_outputs_match_oracle_and_blocks_return() -> None:
    core, worker, blocks = make_engine(num_gpu_blocks=200)
    rng = random.Random(1)
    prompts = random_prompts(12, rng)
    lens = [rng.randint(1, 20) for _ in prompts]
    for i, (p, n) in enumerate(zip(prompts, lens)):
        add(core, f"r{i}", p, n, t=i)
    out = collect(core.run_until_idle())
    for i, (p, n) in enumerate(zip(prompts, lens)):
        assert out[f"r{i}"] == (expected_output(p, n, VOCAB), "length")
    assert_all_free(core, blocks)


def test_budget_and_max_num_seqs_never_exceeded() -> None:
    core, worker, blocks = make_engine(num_gpu_blocks=400, budget=20, max_num_seqs=5)
    rng = random.Random(2)
    for i, p in enumerate(random_prompts(20, rng, 5, 60)):
        add(core, f"r{i}", p, rng.randint(1, 10), t=i)
    core.run_until_idle()
    assert worker.steps
    for st in worker.steps:
        assert sum(s.num_tokens for s in st.scheduled) <= 20
        assert len(st.scheduled) <= 5


def test_admission_is_fcfs() -> None:
    core, worker, blocks = make_engine(num_gpu_blocks=400, max_num_seqs=1)
    for i in range(4):
        add(core, f"r{i}", [1, 2, 3, i], 3, t=i)
    order = [d.request_id for d in core.run_until_idle() if d.finish_reason]
    assert order == ["r0", "r1", "r2", "r3"]


def test_chunked_prefill_interleaves_with_running_decodes() -> None:
    core, worker, blocks = make_engine(num_gpu_blocks=400, budget=16)
    add(core, "short", [5, 6, 7], 30, t=0)
    first = core.step()  # prefill of the short request
    long_prompt = list(range(1, 101))
    add(core, "long", long_prompt, 5, t=1)
    out = collect(first + core.run_until_idle())
    assert out["long"] == (expected_output(long_prompt, 5, VOCAB), "length")
    assert out["short"] == (expected_output([5, 6, 7], 30, VOCAB), "length")
    # While the long prompt was prefilled in chunks, the short request decoded every step.
    short_id, long_id = 1, 2
    chunk_steps = [st for st in worker.steps if any(s.seq_id == long_id and s.num_tokens > 1 for s in st.scheduled)]
    assert len(chunk_steps) >= 100 // 16
    for st in chunk_steps:
        sched = {s.seq_id: s.num_tokens for s in st.scheduled}
        assert sched.get(short_id) == 1
        assert sum(sched.values()) <= 16


@pytest.mark.parametrize("mode,cpu_blocks", [("recompute", 0), ("swap", 64)])
def test_preemption_under_memory_pressure_keeps_outputs(mode: str, cpu_blocks: int) -> None:
    core, worker, blocks = make_engine(num_gpu_blocks=24, num_cpu_blocks=cpu_blocks, mode=mode)
    rng = random.Random(3)
    prompts = random_prompts(10, rng, 4, 12)
    lens = [rng.randint(10, 30) for _ in prompts]
    for i, (p, n) in enumerate(zip(prompts, lens)):
        add(core, f"r{i}", p, n, t=i)
    out = collect(core.run_until_idle())
    for i, (p, n) in enumerate(zip(prompts, lens)):
        assert out[f"r{i}"] == (expected_output(p, n, VOCAB), "length"), f"r{i}"
    assert core.scheduler.num_preemptions > 0
    if mode == "swap":
        assert any(st.swap_out for st in worker.steps) and any(st.swap_in for st in worker.steps)
    else:
        assert not any(st.swap_out for st in worker.steps)
    assert_all_free(core, blocks)


def test_preemption_victim_is_latest_arrival() -> None:
    # 3 requests that fit at first, then outgrow the pool: the last one goes first.
    core, worker, blocks = make_engine(num_gpu_blocks=10)  # 9 usable blocks of 4 tokens
    for i in range(3):
        add(core, f"r{i}", [10 + i, 20, 30, 40], 12, t=i)
    deltas = core.step()
    sch = core.scheduler
    assert [g.request_id for g in sch.running] == ["r0", "r1", "r2"]
    while sch.num_preemptions == 0:
        deltas += core.step()
    assert [g.request_id for g in sch.waiting] == ["r2"]
    assert [g.request_id for g in sch.running] == ["r0", "r1"]
    out = collect(deltas + core.run_until_idle())
    for i in range(3):
        assert out[f"r{i}"][0] == expected_output([10 + i, 20, 30, 40], 12, VOCAB)


def test_recompute_then_resume_reuses_prefix_cache() -> None:
    core, worker, blocks = make_engine(num_gpu_blocks=10)
    for i in range(3):
        add(core, f"r{i}", [1, 2, 3, 4, 5, 6, 7, 8 + i], 12, t=i)
    out = collect(core.run_until_idle())
    for i in range(3):
        assert out[f"r{i}"][0] == expected_output([1, 2, 3, 4, 5, 6, 7, 8 + i], 12, VOCAB)
    assert core.scheduler.num_preemptions > 0
    readmitted = [ns for st in worker.steps for ns in st.new_seqs if len(ns.token_ids) > ns.num_prompt_tokens]
    assert readmitted, "a preempted request was re-admitted with its generated tokens"
    assert blocks.manager.stats().prefix_cache_hits > 0


def test_swap_out_then_swap_in_order() -> None:
    core, worker, blocks = make_engine(num_gpu_blocks=10, num_cpu_blocks=32, mode="swap")
    for i in range(3):
        add(core, f"r{i}", [10 + i, 20, 30, 40], 12, t=i)
    core.run_until_idle()
    outs = [i for i, st in enumerate(worker.steps) if st.swap_out]
    ins = [i for i, st in enumerate(worker.steps) if st.swap_in]
    assert outs and ins and outs[0] < ins[0]
    # The swapped-in blocks are exactly the CPU blocks written by the swap-out.
    cpu_out = {cpu for st in worker.steps for _, cpu in st.swap_out}
    cpu_in = {cpu for st in worker.steps for cpu, _ in st.swap_in}
    assert cpu_in <= cpu_out


@pytest.mark.parametrize("where", ["waiting", "running", "swapped"])
def test_abort_frees_everything(where: str) -> None:
    core, worker, blocks = make_engine(num_gpu_blocks=10, num_cpu_blocks=32, mode="swap", max_num_seqs=3)
    for i in range(4):
        add(core, f"r{i}", [10 + i, 20, 30, 40], 20, t=i)
    sch = core.scheduler
    for _ in range(200):
        core.step()
        pool = {"waiting": sch.waiting, "running": sch.running, "swapped": sch.swapped}[where]
        if pool:
            break
    victim = pool[-1].request_id
    core.handle(AbortRequest([victim]))
    deltas = core.run_until_idle()
    assert any(d.request_id == victim and d.finish_reason == "abort" for d in deltas)
    assert_all_free(core, blocks)


def test_request_that_can_never_fit_gets_an_error() -> None:
    core, worker, blocks = make_engine(num_gpu_blocks=4)  # 3 usable blocks: 12 tokens
    add(core, "big", list(range(1, 30)), 3)
    add(core, "grows", [1, 2, 3], 40)
    out = core.run_until_idle()
    errs = {d.request_id: d.error for d in out if d.finish_reason == "error"}
    assert "big" in errs and "KV blocks" in errs["big"]
    assert "grows" in errs and "outgrew" in errs["grows"]
    # The kind, not the text, picks the status code (frontend/core/error_table.ENGINE_ERRORS).
    assert {d.error_kind for d in out if d.finish_reason == "error"} == {ErrorKind.KV_CACHE}
    assert_all_free(core, blocks)


def test_first_delta_carries_queue_time() -> None:
    import time

    core, worker, blocks = make_engine(num_gpu_blocks=100, max_num_seqs=1)
    now = time.time()
    add(core, "a", [1, 2, 3], 3, t=now)
    add(core, "b", [4, 5, 6], 3, t=now)
    deltas = core.run_until_idle()
    firsts = {}
    for d in deltas:
        firsts.setdefault(d.request_id, d)
    assert all(d.queue_time_s is not None for d in firsts.values())
    assert firsts["b"].queue_time_s >= firsts["a"].queue_time_s  # b waited for a (max_num_seqs=1)
    assert sum(d.queue_time_s is not None for d in deltas) == 2


def test_beam_search_without_logprobs_fails_instead_of_hanging() -> None:
    core, worker, blocks = make_engine(num_gpu_blocks=100)
    core.handle(AddRequest("beam", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0, beam_width=2, n=2), 0.0))
    deltas = core.run_until_idle(max_steps=50)
    assert [d.finish_reason for d in deltas if d.request_id == "beam"][-1] == "error"
    assert not core.has_work() or core.step() == []
    assert_all_free(core, blocks)


def test_kv_watermark_holds_back_admissions() -> None:
    """--kv-watermark reaches the blockmgr: admissions leave that share of blocks free."""
    cfg = EngineConfig(block_size=8, kv_watermark=0.2, max_num_seqs=64, max_num_batched_tokens=4096)
    blocks = InProcessBlockClient(lambda i: BlockManager(i.num_gpu_blocks, i.num_cpu_blocks, i.block_size,
                                                         i.enable_prefix_caching, i.watermark))
    core = EngineCore(cfg, blocks, InProcessWorkerClient(SimWorker(101, 4, vocab_size=VOCAB)))
    assert blocks.manager.watermark_blocks == 20
    for i in range(50):
        add(core, f"r{i}", [1 + i, 2, 3, 4, 5, 6, 7, 8], 2, t=i)  # 2 blocks of 4 tokens each
    core.step()
    s = blocks.manager.stats()
    assert len(core.scheduler.running) == 40 and len(core.scheduler.waiting) == 10
    assert s.num_free_gpu_blocks == 20  # admissions stopped at the watermark


def test_a_reply_that_does_not_pair_with_its_request_is_refused() -> None:
    from pagedserve.common.messages import blockmgr as bm
    from pagedserve.scheduler.core import BlockReplyMismatch

    core, _, blocks = make_engine(num_gpu_blocks=32)
    add(core, "a", [1, 2, 3], 2)
    sch = core.scheduler
    plan = sch.schedule()
    assert plan is not None
    reply = blocks.call(plan.request)
    assert isinstance(reply, bm.StepReply) and len(reply.results) == 1
    with pytest.raises(BlockReplyMismatch):
        sch.on_block_reply(plan, bm.StepReply(reply.results * 2, [], [], [], reply.stats))


def test_prompt_logprobs_skip_the_prefix_lookup_and_counts_are_published() -> None:
    core, worker, _ = make_engine(num_gpu_blocks=64)
    prompt = list(range(1, 18))
    add(core, "warm", prompt, 1)
    core.run_until_idle()
    core.handle(AddRequest("lp", prompt, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0), 0.0))
    core.handle(AddRequest("hit", prompt, SamplingParams(max_tokens=1, temperature=0.0), 0.0))
    assert core.counts.num_waiting == 2  # published after each message
    core.step()
    new = {n.seq_id: n.num_computed_tokens for n in worker.steps[-1].new_seqs}
    assert sorted(new.values()) == [0, 16]  # the prompt-logprobs one computes everything
    assert core.counts.num_waiting == 0 and core.counts.num_steps == core.scheduler.num_steps  # both ran and finished


def parallel_requests(seed: int) -> list[AddRequest]:
    rng = random.Random(seed)
    return [AddRequest(f"r{i}", [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 20))],
                       SamplingParams(max_tokens=rng.randint(5, 40), temperature=0.0, n=rng.choice([1, 2, 3])), float(i))
            for i in range(rng.randint(4, 12))]


@pytest.mark.parametrize("seed,num_gpu_blocks,mode,num_cpu_blocks",
                         [(24, 45, "recompute", 0), (24, 45, "swap", 100), (25, 60, "swap", 100)])
def test_a_victim_whose_retry_was_queued_is_not_scheduled(seed: int, num_gpu_blocks: int, mode: str,
                                                          num_cpu_blocks: int) -> None:
    """Issue 11's intermittent bug, found in-process: two samples of the latest
    group fail to append in one round; the first one's retry is queued, then
    the second one's need preempts that very group. Its queued Append came
    back OK and scheduled a sequence the worker had dropped ("unknown seq",
    recompute) or whose blocks were swapped out (wrong K/V, swap). These
    workloads hit it; each output must equal the oracle."""
    core, worker, blocks = make_engine(num_gpu_blocks, num_cpu_blocks=num_cpu_blocks, mode=mode, budget=64,
                                       max_num_seqs=16)
    reqs = parallel_requests(seed)
    for r in reqs:
        core.handle(r)
    got: dict[tuple[str, int], list[int]] = {}
    for d in core.run_until_idle():
        assert d.error is None, d.error
        got[(d.request_id, d.index)] = got.get((d.request_id, d.index), []) + d.token_ids
    assert core.scheduler.num_preemptions > 0
    for r in reqs:
        for i in range(r.params.n):
            assert got[(r.request_id, i)] == expected_output(r.prompt_token_ids, r.params.max_tokens, VOCAB)
    assert_all_free(core, blocks)
