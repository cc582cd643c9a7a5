"""Async scheduling (issue 10): the scheduler and the blockmgr plan step N+1
while the worker runs step N. It must give exactly the tokens of synchronous
scheduling, with preemption (recompute and swap), stop tokens found only
when step N returns, parallel sampling, beam search and prefix sharing; and
every block must come back.

The in-process worker client runs a step only when its result is collected,
after the next step was planned: the order a slow worker gives. The
SIMULATED worker checks every block table it is sent; the tiny Llama runs
the real sampler (seeded sampling, beam search's top logprobs)."""
from __future__ import annotations

import random
from typing import Any

import pytest
from models import make_tiny_model
from test_scheduler import VOCAB, assert_all_free

from pagedserve.blockmgr.manager import BlockManager
from pagedserve.common.config import EngineConfig
from pagedserve.common.messages import blockmgr as bm
from pagedserve.common.messages import worker as wk
from pagedserve.common.messages.frontend import AbortRequest, AddRequest, TokenDelta
from pagedserve.common.messages.types import SamplingParams
from pagedserve.gpuworker.model_runner import ModelRunner
from pagedserve.gpuworker.sim_worker import SimWorker
from pagedserve.scheduler.engine import EngineCore, InProcessBlockClient, InProcessWorkerClient

Outputs = dict[tuple[str, int], tuple[list[int], str | None]]


class OrderLog:
    """Counts blockmgr rounds that began a step while a worker step was in flight."""

    def __init__(self) -> None:
        self.in_flight = False
        self.overlapped_rounds = 0
        self.steps = 0


class LoggedWorker(InProcessWorkerClient):
    def __init__(self, runner: Any, log: OrderLog) -> None:
        super().__init__(runner)
        self.log = log

    def submit(self, req: wk.ExecuteStep) -> None:
        self.log.in_flight = True
        super().submit(req)

    def collect(self) -> wk.Reply:
        self.log.in_flight = False
        return super().collect()

    def call(self, req: wk.Request, timeout_s: float | None = None) -> wk.Reply:
        if isinstance(req, wk.ExecuteStep):
            self.log.steps += 1
        return super().call(req, timeout_s)


class LoggedBlocks(InProcessBlockClient):
    def __init__(self, log: OrderLog) -> None:
        super().__init__(lambda i: BlockManager(i.num_gpu_blocks, i.num_cpu_blocks, i.block_size,
                                                i.enable_prefix_caching, i.watermark))
        self.log = log

    def call(self, req: bm.Request, timeout_s: float | None = None) -> bm.Reply:
        if isinstance(req, bm.StepRequest) and not req.continues_step and self.log.in_flight:
            self.log.overlapped_rounds += 1
        return super().call(req, timeout_s)


def run(cfg: EngineConfig, runner: Any, requests: list[AddRequest], arrive_every: int = 3
        ) -> tuple[Outputs, EngineCore, OrderLog, LoggedBlocks]:
    """Requests arrive a few at a time between steps, as from the frontend."""
    log = OrderLog()
    blocks = LoggedBlocks(log)
    core = EngineCore(cfg, blocks, LoggedWorker(runner, log))
    deltas: list[TokenDelta] = []
    pending = list(requests)
    for _ in range(100_000):
        for _ in range(min(arrive_every, len(pending))):
            core.handle(pending.pop(0))
        if not pending and not core.has_work():
            break
        deltas += core.step()
    deltas += core.scheduler.take_deltas()
    out: Outputs = {}
    for d in deltas:
        toks, _ = out.get((d.request_id, d.index), ([], None))
        out[(d.request_id, d.index)] = (d.token_ids if d.replace else toks + d.token_ids, d.finish_reason)
    return out, core, log, blocks


def sim_requests(seed: int) -> list[AddRequest]:
    rng = random.Random(seed)
    shared = [rng.randrange(1, VOCAB) for _ in range(24)]  # a common prefix: prefix-cache hits
    reqs = []
    for i in range(24):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 40))]
        p = SamplingParams(max_tokens=rng.randint(1, 60), temperature=0.0, n=2 if i % 5 == 4 else 1,
                           stop_token_ids=[7, 11] if i % 4 == 1 else [])
        reqs.append(AddRequest(f"r{i}", prompt, p, float(i)))
    return reqs


@pytest.mark.parametrize("mode,num_cpu_blocks", [("recompute", 0), ("swap", 200), ("auto", 200)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_async_equals_sync_with_preemption_sim(mode: str, num_cpu_blocks: int, seed: int) -> None:
    def once(async_scheduling: bool) -> tuple[Outputs, EngineCore, OrderLog, LoggedBlocks]:
        cfg = EngineConfig(block_size=8, max_num_seqs=16, max_num_batched_tokens=96, preemption_mode=mode,
                           async_scheduling="on" if async_scheduling else "off")
        # EOS 3 and stop ids 7, 11: stops the scheduler learns of one step late
        worker = SimWorker(48, 8, num_cpu_blocks, VOCAB, max_model_len=4096, eos_token_ids=(3,))
        return run(cfg, worker, sim_requests(seed))

    sync, _, sync_log, _ = once(False)
    got, core, log, blocks = once(True)
    assert got == sync
    assert len(got) == 24 + sum(1 for r in sim_requests(seed) if r.params.n == 2)
    assert all(reason is not None for _, reason in got.values())
    assert any(reason == "stop" for _, reason in got.values()), "no stop token: nothing learnt late"
    assert core.scheduler.num_preemptions > 0, "no preemption happened"
    assert sync_log.overlapped_rounds == 0
    # Most steps were planned while the previous one ran.
    assert log.overlapped_rounds > log.steps // 2, (log.overlapped_rounds, log.steps)
    assert_all_free(core, blocks)


def test_stop_found_late_runs_no_extra_token() -> None:
    """A stop token sampled in step N is known only after step N+1 was planned:
    N+1 is sent without that sequence, and its reserved slot is freed."""
    cfg = EngineConfig(block_size=8, max_num_seqs=4, async_scheduling="on")
    worker = SimWorker(40, 8, 0, VOCAB, max_model_len=4096)
    prompt = [5, 9, 13]
    free_run, *_ = run(cfg, SimWorker(40, 8, 0, VOCAB, max_model_len=4096),
                       [AddRequest("a", prompt, SamplingParams(max_tokens=30, temperature=0.0), 0.0)])
    tokens = free_run[("a", 0)][0]
    stop = tokens[4]  # the fifth token stops it
    assert stop not in tokens[:4]
    got, core, log, blocks = run(cfg, worker, [AddRequest("a", prompt, SamplingParams(
        max_tokens=30, temperature=0.0, stop_token_ids=[stop]), 0.0)])
    assert got[("a", 0)] == (tokens[:5], "stop")
    # Prompt plus five tokens: the worker computed the prompt and four sampled tokens, never the stop token.
    assert worker.tokens_computed == len(prompt) + 4
    assert log.overlapped_rounds >= 3
    assert_all_free(core, blocks)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("async_llama"), "llama", seed=3, num_hidden_layers=2)


def model_requests() -> list[AddRequest]:
    rng = random.Random(5)
    reqs = []
    for i in range(10):
        prompt = [rng.randrange(1, 400) for _ in range(rng.randint(4, 24))]
        if i < 3:
            p = SamplingParams(max_tokens=rng.randint(20, 40), n=3, temperature=0.9, top_p=0.95, seed=100 + i,
                               ignore_eos=True)
        elif i < 5:
            p = SamplingParams(max_tokens=rng.randint(20, 40), beam_width=3, n=2, temperature=0.0, ignore_eos=True)
        elif i % 2:
            p = SamplingParams(max_tokens=rng.randint(20, 40), temperature=0.8, seed=i, ignore_eos=True)
        else:
            p = SamplingParams(max_tokens=rng.randint(20, 40), temperature=0.0, ignore_eos=True)
        reqs.append(AddRequest(f"m{i}", prompt, p, float(i)))
    return reqs


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_async_equals_sync_with_preemption_model(tiny_llama: str, mode: str) -> None:
    """Seeded sampling, parallel sampling and beam search on a real model,
    in a pool small enough to preempt."""
    def once(async_scheduling: bool) -> tuple[Outputs, EngineCore, OrderLog, LoggedBlocks]:
        cfg = EngineConfig(model=tiny_llama, block_size=8, num_gpu_blocks=40, max_num_seqs=16,
                           swap_space=0.01 if mode == "swap" else 0.0, preemption_mode=mode,
                           async_scheduling="on" if async_scheduling else "off")
        return run(cfg, ModelRunner(cfg), model_requests())

    sync, sync_core, _, _ = once(False)
    got, core, log, blocks = once(True)
    assert sync_core.scheduler.num_preemptions > 0 and core.scheduler.num_preemptions > 0, "no preemption happened"
    assert got == sync
    assert log.overlapped_rounds > log.steps // 2, (log.overlapped_rounds, log.steps)
    assert_all_free(core, blocks)


class FailingWorker(LoggedWorker):
    """Answers the ``fail_at``-th step with a WorkerError."""

    def __init__(self, runner: Any, log: OrderLog, fail_at: int) -> None:
        super().__init__(runner, log)
        self.fail_at = fail_at

    def call(self, req: wk.Request, timeout_s: float | None = None) -> wk.Reply:
        rep = super().call(req, timeout_s)
        return wk.WorkerError("boom") if isinstance(req, wk.ExecuteStep) and self.log.steps == self.fail_at else rep


def test_a_request_aborted_while_its_step_runs_then_the_step_fails() -> None:
    """The abort lands between sending a step and its result (the scheduler
    forgets the group at once); that step then fails: the other request ends
    with the error, the scheduler keeps serving, and every block comes back."""
    cfg = EngineConfig(block_size=8, async_scheduling="on")
    log = OrderLog()
    blocks = LoggedBlocks(log)
    core = EngineCore(cfg, blocks, FailingWorker(SimWorker(40, 8, 0, VOCAB, max_model_len=4096), log, fail_at=3))
    for rid in ("a", "b"):
        core.handle(AddRequest(rid, [5, 9, 13], SamplingParams(max_tokens=30, temperature=0.0), 0.0))
    deltas: list[TokenDelta] = []
    for _ in range(3):
        deltas += core.step()
    assert log.in_flight and log.steps == 2  # step 3 is in flight
    core.handle(AbortRequest(["a"]))
    deltas += core.step()  # step 3 (with "a") fails
    deltas += core.run_until_idle()
    ends = {d.request_id: (d.finish_reason, d.error) for d in deltas if d.finish_reason}
    assert ends == {"a": ("abort", None), "b": ("error", "boom")}
    core.handle(AddRequest("c", [5, 9, 13], SamplingParams(max_tokens=3, temperature=0.0), 0.0))
    assert [d.finish_reason for d in core.run_until_idle() if d.request_id == "c"][-1] == "length"
    assert_all_free(core, blocks)


@pytest.mark.parametrize("seed,num_gpu_blocks", [(38, 12), (39, 16)])
def test_blocks_of_a_sequence_finished_in_flight_count_before_outgrowing(seed: int, num_gpu_blocks: int) -> None:
    """The only running sequence finds no room while the step in flight has
    just finished the others: their blocks are freed in that same round, so
    it is not failed as outgrowing the pool (synchronous scheduling has freed
    them already). Each request fits alone; together they do not. These
    workloads failed one request before the fix."""
    rng = random.Random(seed)
    reqs = [AddRequest(f"r{i}", [rng.randrange(1, VOCAB) for _ in range(rng.randint(10, 50))],
                       SamplingParams(max_tokens=rng.randint(20, 60), temperature=0.0), float(i)) for i in range(12)]

    def once(async_scheduling: bool) -> tuple[Outputs, EngineCore, LoggedBlocks]:
        cfg = EngineConfig(block_size=8, async_scheduling="on" if async_scheduling else "off")
        out, core, _, blocks = run(cfg, SimWorker(num_gpu_blocks, 8, 0, VOCAB, max_model_len=4096), reqs,
                                   arrive_every=12)
        return out, core, blocks

    sync, _, _ = once(False)
    got, core, blocks = once(True)
    assert all(reason == "length" for _, reason in sync.values())
    assert got == sync
    assert core.scheduler.num_preemptions > 0
    assert_all_free(core, blocks)
