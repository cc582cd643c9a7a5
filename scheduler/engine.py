"""EngineCore: the step loop's logic, with the blockmgr and worker behind two
small client interfaces. The in-process clients call the pure classes
directly (tests, benchmarks); the IPC clients talk to the real processes.
Both run the same core.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Protocol

import zmq

from pagedserve.common import ipc
from pagedserve.common.config import EngineConfig
from pagedserve.common.messages import blockmgr as bm
from pagedserve.common.messages import frontend as fe
from pagedserve.common.messages import worker as wk
from pagedserve.common.messages.types import RefusalKind
from pagedserve.scheduler.config import PoolSize, SchedulerConfig
from pagedserve.scheduler.core import Scheduler
from pagedserve.scheduler.plan import StepPlan

RECOVERY_ATTEMPT_S = 0.5  # one try at a restarting component; between tries the inbox is served


class BlockClient(Protocol):
    def call(self, req: bm.Request, timeout_s: float | None = None) -> bm.Reply: ...


class WorkerClient(Protocol):
    def call(self, req: wk.Request, timeout_s: float | None = None) -> wk.Reply: ...
    # ``call`` in two halves, so a step runs while the next one is planned.
    def submit(self, req: wk.ExecuteStep) -> None: ...
    def collect(self) -> wk.Reply: ...


class ComponentError(RuntimeError):
    """A component answered with an error, or not at all."""


class PeerRefused(ComponentError):
    """A component still serves another scheduler (kind wrong_peer): a
    restarted scheduler whose predecessor's connection has not closed yet."""


class InProcessBlockClient:
    def __init__(self, manager_factory: Any) -> None:
        # manager_factory(InitRequest) -> BlockManager; built on InitRequest like the service.
        self._factory = manager_factory
        self.manager: Any = None

    def call(self, req: bm.Request, timeout_s: float | None = None) -> bm.Reply:
        if isinstance(req, bm.InitRequest):
            self.manager = self._factory(req)
            return bm.Ack()
        if isinstance(req, bm.StepRequest):
            return self.manager.step(req)
        if isinstance(req, bm.StatsRequest):
            return self.manager.stats()
        self.manager.reset()
        return bm.Ack()


class InProcessWorkerClient:
    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self._submitted: wk.ExecuteStep | None = None

    def submit(self, req: wk.ExecuteStep) -> None:
        self._submitted = req

    def collect(self) -> wk.Reply:
        # Runs the step only now, after the next one was planned: the order a
        # slow worker gives, which async scheduling must get right.
        req, self._submitted = self._submitted, None
        assert req is not None, "collect without submit"
        return self.call(req)

    def call(self, req: wk.Request, timeout_s: float | None = None) -> wk.Reply:
        if isinstance(req, wk.InitWorker):
            return self.runner.init()
        if isinstance(req, wk.ExecuteStep):
            return self.runner.execute(req)
        if isinstance(req, wk.ResetWorker):
            self.runner.reset()
        return wk.WorkerAck()


class IpcClient:
    """Request/reply over ZeroMQ with a timeout per call."""

    def __init__(self, ctx: zmq.Context[Any], addr: str, reply_type: Any, timeout_s: float,
                 stop: Callable[[], bool] | None = None, while_waiting: Callable[[], None] | None = None) -> None:
        self._client: ipc.ReqClient[Any] = ipc.ReqClient(ctx, addr, reply_type)
        self.timeout_s = timeout_s
        self._stop = stop  # checked every ipc.POLL_MS while waiting (SIGTERM)
        # Also run every ipc.POLL_MS while waiting: the control loop answers the
        # frontend during a slow step instead of looking dead (issue 19).
        self.while_waiting = while_waiting

    def _waited(self) -> bool:
        if self.while_waiting is not None:
            self.while_waiting()
        return self._stop is not None and self._stop()

    def disconnected(self) -> bool:
        return self._client._peer_lost()  # drains the monitor: true once per disconnect

    def call(self, req: Any, timeout_s: float | None = None) -> Any:
        self.submit(req)
        return self.collect(timeout_s)

    def submit(self, req: Any) -> None:
        # A disconnect since the last call means a restarted peer that lost
        # our state: fail this call (recovery follows) rather than talk past it.
        if self.disconnected():
            raise ComponentError(f"{self._client.addr} disconnected since the last call")
        self._client.send(req)

    def collect(self, timeout_s: float | None = None) -> Any:
        try:
            return self._client.reply(timeout_s or self.timeout_s, self._waited)
        except (ipc.ChannelTimeout, ipc.PeerLost, ipc.Interrupted, ipc.BadFrame) as e:
            raise ComponentError(str(e)) from e

    def close(self) -> None:
        self._client.close()


@dataclasses.dataclass(frozen=True)
class SchedulerCounts:
    """What the scheduler's metrics show, published by the step loop after each
    step and message (the metrics thread reads this, never the scheduler)."""

    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    block_stats: bm.BlockStats | None = None


class EngineCore:
    def __init__(self, cfg: EngineConfig, blockmgr: BlockClient, worker: WorkerClient,
                 init_timeout_s: float | None = None) -> None:
        self.cfg = cfg
        self.blockmgr = blockmgr
        self.worker = worker
        self._step_began: float | None = None  # monotonic start of the step now running
        self.recovering = False  # between losing a component and both answering again
        self.num_recoveries = 0
        self.counts = SchedulerCounts()
        ready = self._worker_call(wk.InitWorker(), init_timeout_s)
        assert isinstance(ready, wk.WorkerReady)
        # A worker that outlived a previous scheduler still holds its sequences.
        self._worker_call(wk.ResetWorker())
        self.ready = ready
        self._block_call(bm.InitRequest(ready.num_gpu_blocks, ready.num_cpu_blocks, ready.block_size,
                                        cfg.enable_prefix_caching, cfg.kv_watermark, list(ready.kv_group_windows)))
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=cfg.max_num_seqs,
            # No chunked prefill: the budget grows to the model's length (vLLM's default then).
            max_num_batched_tokens=cfg.max_num_batched_tokens if cfg.enable_chunked_prefill else max(
                cfg.max_num_batched_tokens, ready.model.max_model_len),
            block_size=ready.block_size,
            max_model_len=ready.model.max_model_len,
            eos_token_ids=ready.model.eos_token_ids,
            preemption_mode=cfg.preemption_mode,
            enable_chunked_prefill=cfg.enable_chunked_prefill,
            kv_group_windows=tuple(ready.kv_group_windows),
        ), PoolSize(ready.num_usable_gpu_blocks, ready.num_cpu_blocks))

    def _worker_call(self, req: wk.Request, timeout_s: float | None = None) -> wk.Reply:
        rep = self.worker.call(req, timeout_s)
        if isinstance(rep, wk.WorkerError):
            raise (PeerRefused if rep.kind is RefusalKind.WRONG_PEER else ComponentError)(f"gpuworker: {rep.message}")
        return rep

    def _block_call(self, req: bm.Request, timeout_s: float | None = None) -> bm.Reply:
        rep = self.blockmgr.call(req, timeout_s)
        if isinstance(rep, bm.ErrorReply):
            raise (PeerRefused if rep.kind is RefusalKind.WRONG_PEER else ComponentError)(f"blockmgr: {rep.message}")
        return rep

    def info(self, query_id: int) -> fe.EngineInfo:
        return fe.EngineInfo(query_id, self.ready.model, self.ready.block_size, self.ready.num_gpu_blocks,
                             self.ready.num_cpu_blocks, self.cfg.max_num_seqs, self.cfg.max_num_batched_tokens)

    def stats(self, query_id: int) -> fe.EngineStats:
        """Between steps: fresh block counts from the blockmgr. During a step
        (asked while a component is awaited): the counts of its last reply,
        and how long the step has run, without a call of our own."""
        sch = self.scheduler
        running_s = 0.0 if self._step_began is None else time.monotonic() - self._step_began
        if self.recovering:  # the blockmgr may be gone: no block counts to report
            return fe.EngineStats(query_id, len(sch.running), sch.num_waiting, len(sch.swapped),
                                  0, 0, 0, 0, 0, 0, sch.num_preemptions, sch.num_steps, recovering=True,
                                  step_running_s=running_s, num_waiting_deferred=len(sch.grammars.waiting))
        if self._step_began is None:
            s = self._block_call(bm.StatsRequest())
        else:
            s = sch.block_stats or bm.BlockStats(self.ready.num_gpu_blocks, 0, self.ready.num_cpu_blocks, 0, 0)
        assert isinstance(s, bm.BlockStats)
        return fe.EngineStats(query_id, len(sch.running), sch.num_waiting, len(sch.swapped),
                              s.num_gpu_blocks, s.num_free_gpu_blocks, s.num_cpu_blocks, s.num_free_cpu_blocks,
                              s.prefix_cache_queries, s.prefix_cache_hits, sch.num_preemptions, sch.num_steps,
                              step_running_s=running_s, num_waiting_deferred=len(sch.grammars.waiting))

    @property
    def in_step(self) -> bool:
        """A step (or recovery) is running: only answers that need no call of ours are safe."""
        return self._step_began is not None or self.recovering

    def check_peers(self) -> None:
        """Raises ComponentError if a component disconnected since the last
        call (noticed while idle, so health turns NOT_SERVING at once)."""
        for name, client in (("gpuworker", self.worker), ("blockmgr", self.blockmgr)):
            lost: Callable[[], bool] | None = getattr(client, "disconnected", None)
            if lost is not None and lost():
                raise ComponentError(f"{name} disconnected")

    def recover(self, idle: Callable[[], None], stop: Callable[[], bool],
                timeout_s: float | None = None) -> int:
        """After a lost component: requeues every request for recompute, then
        waits (bounded attempts, ``idle()`` between them) until the worker
        answers InitWorker, resets its sequence state and re-initialises the
        blockmgr (every block free). Raises ComponentError on ``stop()`` or
        after ``timeout_s``. Returns how many requests were in flight."""
        self.recovering = True
        n = self.scheduler.requeue_all()  # a step in flight is forgotten: its result never comes
        deadline = None if timeout_s is None else time.monotonic() + timeout_s

        def retry(attempt: Callable[[], Any]) -> Any:
            while True:
                try:
                    return attempt()
                except ComponentError:
                    if stop() or (deadline is not None and time.monotonic() > deadline):
                        raise
                    idle()

        ready = retry(lambda: self._worker_call(wk.InitWorker(), RECOVERY_ATTEMPT_S))
        assert isinstance(ready, wk.WorkerReady)
        retry(lambda: self._worker_call(wk.ResetWorker(), RECOVERY_ATTEMPT_S))
        if (ready.num_gpu_blocks, ready.num_cpu_blocks) != (self.ready.num_gpu_blocks, self.ready.num_cpu_blocks):
            # A restarted worker may size its pool differently (free GPU memory moved).
            self.scheduler.resize(PoolSize(ready.num_usable_gpu_blocks, ready.num_cpu_blocks))
        self.ready = ready
        retry(lambda: self._block_call(bm.InitRequest(ready.num_gpu_blocks, ready.num_cpu_blocks, ready.block_size,
                                                      self.cfg.enable_prefix_caching, self.cfg.kv_watermark,
                                                      list(ready.kv_group_windows)),
                                       RECOVERY_ATTEMPT_S))
        self.recovering = False
        self.num_recoveries += 1
        self._publish()
        return n

    def _publish(self) -> None:
        sch = self.scheduler
        self.counts = SchedulerCounts(len(sch.running), sch.num_waiting, len(sch.swapped), sch.num_preemptions,
                                      sch.num_steps, sch.block_stats)

    def handle(self, msg: fe.Request) -> fe.Reply | None:
        reply = self._handle(msg)
        self._publish()
        return reply

    def _handle(self, msg: fe.Request) -> fe.Reply | None:
        if isinstance(msg, fe.AddRequest):
            self.scheduler.add_request(msg)
        elif isinstance(msg, fe.AbortRequest):
            self.scheduler.abort(msg.request_ids)
        elif isinstance(msg, fe.InfoQuery):
            return self.info(msg.query_id)
        elif isinstance(msg, fe.StatsQuery):
            return self.stats(msg.query_id)
        return None

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[fe.TokenDelta]:
        """One step as typed messages, each reply paired with its request
        (docs/architecture.md, "One engine step"); the plan is this call's."""
        self._step_began = time.monotonic()
        try:
            return self._step()
        finally:
            self._step_began = None
            self._publish()

    def _step(self) -> list[fe.TokenDelta]:
        """Synchronous: plan, run, apply. Async (``cfg.use_async_scheduling``): plan
        step N+1 while the worker runs step N, apply N's result, then send N+1
        (its sequences that N finished left out), so the worker waits only for
        that. Preempting needs N's result first (its victims' tokens), so a
        round that must preempt waits for it."""
        sch = self.scheduler
        deltas: list[fe.TokenDelta] = []
        try:
            plan = sch.schedule()
            if plan is not None:
                req: bm.StepRequest | None = plan.request
                while req is not None:
                    reply = self._block_call(req)
                    assert isinstance(reply, bm.StepReply)
                    if sch.carry.in_flight is not None and sch.must_settle(plan, reply):
                        deltas += self._collect()
                    req = sch.on_block_reply(plan, reply)
            deltas += self._collect()
            execute = None if plan is None else sch.build_execute(plan)
            if execute is not None:
                assert plan is not None
                if self.cfg.use_async_scheduling:
                    self.worker.submit(execute)  # collected by the next step's _collect
                else:
                    deltas += self._apply(plan, self.worker.call(execute))
        except ComponentError:
            # A component lost after a result was applied (a later blockmgr
            # round): its tokens are part of the sequences that resume, so
            # they must still reach their streams.
            sch.put_back(deltas)
            raise
        return deltas + sch.take_deltas()

    def _collect(self) -> list[fe.TokenDelta]:
        """Waits for the step in flight, if any, and applies its result."""
        plan = self.scheduler.carry.in_flight
        if plan is None:
            return []
        return self._apply(plan, self.worker.collect())

    def _apply(self, plan: StepPlan, result: wk.Reply) -> list[fe.TokenDelta]:
        sch = self.scheduler
        if isinstance(result, wk.WorkerError):
            return sch.on_step_failed(plan, result.message)
        assert isinstance(result, wk.StepResult)
        return sch.on_step_result(plan, result)

    def run_until_idle(self, max_steps: int = 1_000_000) -> list[fe.TokenDelta]:
        """Steps until nothing is left (tests and offline benchmarks)."""
        out: list[fe.TokenDelta] = []
        for _ in range(max_steps):
            if not self.has_work():
                break
            out += self.step()
        out += self.scheduler.take_deltas()
        return out
