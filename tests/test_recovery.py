"""Recovery by recompute in-process (issue 11): the worker or the blockmgr
loses all its state mid-run (as a restarted process does); EngineCore.recover
re-initialises both and every request resumes. The outputs must equal an
undisturbed run's, with no duplicated or missing token, and every block must
be free afterwards. Uses the SIMULATED worker, which checks every block table."""
from __future__ import annotations

from typing import Any

import pytest
from test_scheduler import VOCAB, assert_all_free, collect

from pagedserve.blockmgr.manager import BlockManager
from pagedserve.common.config import EngineConfig
from pagedserve.common.messages import blockmgr as bm
from pagedserve.common.messages import worker as wk
from pagedserve.common.messages.frontend import AddRequest, TokenDelta
from pagedserve.common.messages.types import SamplingParams
from pagedserve.gpuworker.sim_worker import SimWorker
from pagedserve.scheduler.engine import ComponentError, EngineCore, InProcessBlockClient, InProcessWorkerClient

BLOCKS = 60


class Crashing:
    """Fails the ``at``-th call of one kind (losing the component's state, as
    SIGKILL and a restart do), then refuses ``down`` more calls (restarting)."""

    def __init__(self, at: int, down: int = 3) -> None:
        self.at, self.down, self.calls, self.crashed = at, down, 0, 0

    def fails(self, counted: bool) -> bool:
        self.calls += counted
        if self.calls == self.at and counted and not self.crashed:
            self.crashed = 1
            return True
        if self.crashed and self.down > 0:
            self.down -= 1
            return True
        return False


class CrashingWorker(InProcessWorkerClient):
    def __init__(self, at: int) -> None:
        super().__init__(self._fresh())
        self.crash = Crashing(at)

    @staticmethod
    def _fresh() -> SimWorker:
        return SimWorker(BLOCKS, 4, 0, VOCAB, max_model_len=4096)

    def call(self, req: wk.Request, timeout_s: float | None = None) -> wk.Reply:
        if self.crash.fails(isinstance(req, wk.ExecuteStep)):
            self.runner = self._fresh()  # a restarted process knows no sequence
            raise ComponentError("gpuworker disconnected")
        return super().call(req, timeout_s)


class CrashingBlocks(InProcessBlockClient):
    """``rounds_only``: counts only the extra rounds of a step (preemption),
    which async scheduling sends after applying the step that was in flight."""

    def __init__(self, at: int, rounds_only: bool = False) -> None:
        super().__init__(lambda i: BlockManager(i.num_gpu_blocks, i.num_cpu_blocks, i.block_size,
                                                i.enable_prefix_caching, i.watermark))
        self.crash = Crashing(at)
        self.rounds_only = rounds_only

    def call(self, req: bm.Request, timeout_s: float | None = None) -> bm.Reply:
        if self.crash.fails(isinstance(req, bm.StepRequest) and (req.continues_step or not self.rounds_only)):
            self.manager = None  # a restarted blockmgr has no manager until InitRequest
            raise ComponentError("blockmgr disconnected")
        if self.manager is None and not isinstance(req, bm.InitRequest):
            raise ComponentError("blockmgr not initialised")
        return super().call(req, timeout_s)


def requests(parallel: bool) -> list[AddRequest]:
    out = []
    for i in range(12):
        prompt = [(7 * i + j) % (VOCAB - 1) + 1 for j in range(5 + 3 * i)]
        n = 2 if parallel and i % 4 == 3 else 1  # parallel sampling shares blocks: recomputed per sequence
        out.append(AddRequest(f"r{i}", prompt, SamplingParams(max_tokens=20 + i, temperature=0.0, n=n,
                                                              seed=i if n > 1 else None), float(i)))
    return out


def run(worker: InProcessWorkerClient, blocks: InProcessBlockClient,
        parallel: bool, async_scheduling: bool = True) -> tuple[list[TokenDelta], EngineCore, int]:
    # With parallel sampling and prefix caching, a group refused after one of
    # its sequences got blocks must free them before they are committed as
    # cached (they hold no K/V): the simulated worker reads them back.
    cfg = EngineConfig(block_size=8, max_num_seqs=16, max_num_batched_tokens=64, enable_prefix_caching=True,
                       async_scheduling="on" if async_scheduling else "off")
    core = EngineCore(cfg, blocks, worker)
    for r in requests(parallel):
        core.handle(r)
    out: list[TokenDelta] = []
    idle_calls: list[int] = []
    for _ in range(10_000):
        if not core.has_work():
            break
        try:
            out += core.step()
        except ComponentError:
            in_flight = core.recover(lambda: idle_calls.append(1), lambda: False, timeout_s=5.0)
            assert in_flight > 0 and not core.recovering
    out += core.scheduler.take_deltas()
    assert_all_free(core, blocks)
    return out, core, len(idle_calls)


def by_output(deltas: list[TokenDelta]) -> dict[tuple[str, int], list[int]]:
    got: dict[tuple[str, int], list[int]] = {}
    for d in deltas:
        assert d.error is None, d
        got[(d.request_id, d.index)] = got.get((d.request_id, d.index), []) + d.token_ids
    return got


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("at", [3, 25, 60])
@pytest.mark.parametrize("victim", ["gpuworker", "blockmgr", "blockmgr-preempting"])
def test_lost_component_loses_no_token(victim: str, at: int, parallel: bool, async_scheduling: bool) -> None:
    expected, ref_core, _ = run(CrashingWorker(at=10**9), CrashingBlocks(at=10**9), parallel, async_scheduling)
    assert ref_core.scheduler.num_preemptions > 0  # the pool is small enough to preempt
    worker = CrashingWorker(at if victim == "gpuworker" else 10**9)
    # blockmgr-preempting: lost in the at-th preemption round (async: after the step in flight was applied)
    preempting = victim == "blockmgr-preempting"
    blocks = CrashingBlocks(10**9 if victim == "gpuworker" else {3: 1, 25: 2, 60: 3}[at] if preempting else at,
                            rounds_only=preempting)
    got, core, idle_calls = run(worker, blocks, parallel, async_scheduling)
    assert (worker.crash.crashed or blocks.crash.crashed) and core.num_recoveries == 1
    assert idle_calls >= 3  # the inbox is served between attempts at the restarting component
    assert by_output(got) == by_output(expected)
    assert {d.request_id: d.finish_reason for d in got if d.finish_reason} == \
        {d.request_id: d.finish_reason for d in expected if d.finish_reason}
    assert collect(got).keys() == collect(expected).keys()


def test_stats_while_recovering_do_not_touch_the_blockmgr() -> None:
    blocks = CrashingBlocks(at=10**9)
    core = EngineCore(EngineConfig(block_size=8), blocks, CrashingWorker(at=10**9))
    blocks.manager = None
    core.recovering = True
    s = core.stats(7)
    assert s.recovering and s.query_id == 7 and s.num_gpu_blocks == 0
    core.recovering = False
    with pytest.raises(ComponentError):
        core.stats(8)


def test_recover_gives_up_on_stop() -> None:
    worker = CrashingWorker(at=10**9)
    core = EngineCore(EngineConfig(block_size=8), CrashingBlocks(at=10**9), worker)
    worker.crash.crashed, worker.crash.down = 1, 10**9  # never comes back
    calls: list[Any] = []
    with pytest.raises(ComponentError):
        core.recover(lambda: calls.append(1), lambda: len(calls) >= 5)
    assert len(calls) == 5 and core.recovering
