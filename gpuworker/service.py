"""``pagedserve gpuworker``: the ModelRunner behind a REP socket.

Loads the model before binding (the scheduler waits for the InitWorker reply
with a generous timeout), then answers one request at a time. A failing
request is answered with WorkerError and the worker keeps serving; SIGTERM or
SIGINT ends the loop and removes the ipc socket file.

With ``--tensor-parallel-size N`` this process is rank 0: it starts ranks
1..N-1 itself (the same command plus hidden ``--tp-rank/--tp-port`` flags,
so launchers and compose need no change), binds the socket, and broadcasts
each request to them; they die with it (PR_SET_PDEATHSIG) and it stops
serving if one of them dies.
"""
from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import traceback

import zmq

from pagedserve.common.lifecycle import StopFlag, die_with_parent
from pagedserve.common.config import (EngineConfig, add_address_args, add_engine_args, config_from_args,
                                      step_trace, worker_adaptive, worker_threads)
from pagedserve.common.config import addresses_from_args, check_addresses
from pagedserve.common.ipc import BadFrame, RepServer
from pagedserve.common.metrics import add_metrics_arg, serve_worker_metrics
from pagedserve.common.messages import worker as wk
from pagedserve.gpuworker.cpu_affinity import bound_cores
from pagedserve.gpuworker.cpu_contention import ThreadGovernor
from pagedserve.gpuworker.distributed import create_store, init_group, rank_device
from pagedserve.gpuworker.model_runner import ModelRunner
from pagedserve.gpuworker.sim_worker import SimWorker


def handle(runner: "ModelRunner | SimWorker", msg: wk.Request) -> wk.Reply:
    try:
        if isinstance(msg, wk.ExecuteStep):
            return runner.execute(msg)
        if isinstance(msg, wk.InitWorker):
            return runner.init()
        if isinstance(msg, wk.ResetWorker):
            runner.reset()
            return wk.WorkerAck()
        return wk.WorkerAck()  # Shutdown: acknowledged, the loop then exits
    except Exception as e:  # noqa: BLE001 - every failure goes back to the scheduler
        traceback.print_exc(file=sys.stderr)
        return wk.WorkerError(f"{type(e).__name__}: {e}")


def _preload_structured(runner: "ModelRunner | SimWorker") -> None:
    """xgrammar, and the tokenizer's vocabulary for it, before serving: on first
    use they cost seconds (1.6 s for the import alone on 2 cores) inside the
    step loop, stalling every stream (issue 19). Skipped when not installed."""
    import importlib.util

    if not isinstance(runner, ModelRunner) or importlib.util.find_spec("xgrammar") is None:
        return
    import xgrammar  # noqa: F401

    try:
        runner.structured.compiler()
    except Exception as e:  # noqa: BLE001 - e.g. no tokenizer: constrained requests fail, others run
        print(f"pagedserve gpuworker: structured outputs unavailable: {e}", file=sys.stderr, flush=True)


def _limit_cpu_threads(device: str, ranks: int = 1) -> None:
    """On CPU the worker takes every core (shared among tensor-parallel ranks):
    the other three processes sleep in their sockets while it runs a step, and
    use about 2 % of its CPU time. Override with PAGEDSERVE_WORKER_THREADS."""
    import os

    import torch

    threads = worker_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    elif device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))


def _contention_governor(cfg: EngineConfig, ranks: int) -> ThreadGovernor | None:
    """For a single-rank CPU worker whose threads are pinned one per core."""
    import torch

    cores = bound_cores()
    if (cfg.device != "cpu" or ranks != 1 or cfg.worker == "sim" or not worker_adaptive() or cores is None
            or len(cores) < 2 or torch.get_num_threads() != len(cores)):
        return None
    return ThreadGovernor(set(cores), torch.set_num_threads, log=sys.stderr if step_trace() else None)


def _start_ranks(cfg: EngineConfig, argv: list[str]) -> tuple[ModelRunner, list[subprocess.Popen[bytes]]]:
    """Rank 0: open the rendezvous, start ranks 1..N-1, join the group."""
    n = cfg.tensor_parallel_size
    store = create_store(n)
    procs = [
        subprocess.Popen([sys.executable, "-m", "pagedserve", "gpuworker", *argv, "--tp-rank", str(r),
                          "--tp-port", str(store.port)], preexec_fn=die_with_parent)
        for r in range(1, n)
    ]
    try:
        tp = init_group(0, n, rank_device(cfg.device, 0), store=store)
    except BaseException:
        _stop_ranks(procs)
        raise
    return ModelRunner(cfg, tp, hybrid_kv=True), procs


def _stop_ranks(procs: list[subprocess.Popen[bytes]], grace_s: float = 10.0) -> None:
    for p in procs:
        try:
            p.wait(grace_s)  # released by the Shutdown broadcast, or by rank 0's sockets closing
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _follow(cfg: EngineConfig, rank: int, port: int) -> int:
    """Ranks > 0: no socket; run rank 0's requests until it shuts down.
    Ctrl-C reaches the whole process group; rank 0 decides when to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    tp = init_group(rank, cfg.tensor_parallel_size, rank_device(cfg.device, rank), port=port)
    runner = ModelRunner(cfg, tp, hybrid_kv=True)
    try:
        runner.init()
    except Exception as e:  # noqa: BLE001
        print(f"pagedserve gpuworker rank {rank}: failed to start: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    runner.follow()
    tp.destroy()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="pagedserve gpuworker", description="model forward, KV pool and sampling")
    add_engine_args(parser)
    add_address_args(parser)
    add_metrics_arg(parser, "gpuworker")
    parser.add_argument("--tp-rank", type=int, default=0, help=argparse.SUPPRESS)  # set by rank 0 for its ranks
    parser.add_argument("--tp-port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # Fail fast (issue 19): a refused socket must not wait for the model to load first.
    check_addresses(addresses_from_args(args), "gpuworker")
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    tp_size = 1 if cfg.worker == "sim" else cfg.tensor_parallel_size
    _limit_cpu_threads(cfg.device, tp_size)
    if args.tp_rank > 0:
        return _follow(cfg, args.tp_rank, args.tp_port)

    ranks: list[subprocess.Popen[bytes]] = []
    try:
        if cfg.worker == "sim":
            runner: ModelRunner | SimWorker = SimWorker.from_config(cfg)
        elif tp_size > 1:
            runner, ranks = _start_ranks(cfg, argv)
        else:
            runner = ModelRunner(cfg, hybrid_kv=True)
        runner.init()  # a signal during loading just ends the process: no socket exists yet
        _preload_structured(runner)
    except Exception as e:  # noqa: BLE001
        print(f"pagedserve gpuworker: failed to start: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        _stop_ranks(ranks, grace_s=5.0)
        return 1

    governor = _contention_governor(cfg, tp_size)
    stop = StopFlag()
    serve_worker_metrics(args.metrics_port, runner, args.metrics_host)
    ctx = zmq.Context()
    server: RepServer[wk.Request] = RepServer(ctx, args.worker_addr, wk.Request, pin_on=(wk.InitWorker,))
    print(f"pagedserve gpuworker: serving on {args.worker_addr}", file=sys.stderr, flush=True)
    rc = 0
    try:
        while not stop:
            if not server.poll(100):  # wake up regularly to notice signals (and lost ranks)
                if governor is not None:
                    governor.idle()
                if any(p.poll() is not None for p in ranks):
                    print("pagedserve gpuworker: a tensor-parallel rank exited; stopping", file=sys.stderr, flush=True)
                    rc = 1
                    break
                continue
            try:
                msg = server.recv()
            except BadFrame as e:  # counted and logged by recv; the REP socket still owes a reply
                server.send(wk.WorkerError(f"refused: {e}", kind=e.kind))
                continue
            if governor is not None and isinstance(msg, wk.ExecuteStep):
                server.send(governor.run(lambda: handle(runner, msg)))
            else:
                server.send(handle(runner, msg))
            if isinstance(msg, wk.Shutdown):
                break
    finally:
        if isinstance(runner, ModelRunner):
            print(f"pagedserve gpuworker: {runner.gaps.summary()}", file=sys.stderr, flush=True)
        if governor is not None:
            print(f"pagedserve gpuworker: {governor.summary()}", file=sys.stderr, flush=True)
        server.close()
        ctx.term()
        if isinstance(runner, ModelRunner) and rc == 0:
            try:
                runner.shutdown()
                runner.tp.destroy()
            except Exception as e:  # noqa: BLE001 - a lost rank: it is killed below
                print(f"pagedserve gpuworker: tensor-parallel shutdown failed: {e}", file=sys.stderr, flush=True)
        _stop_ranks(ranks, grace_s=10.0 if rc == 0 else 0.1)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
