"""Issue 11: parallel sampling (n > 1) and beam search survive a kill -9 of
the scheduler (resumed by the frontend), the gpuworker or the blockmgr
(resumed by the scheduler). Real processes (``pagedserve serve``, and the
components started by hand as compose runs them), a pool small enough to
preempt; the component is killed mid-stream and restarted. Every output of every stream finishes
without an error and with exactly the tokens of an undisturbed in-process
run; every block is free afterwards."""
from __future__ import annotations

import os
import random
import re
import signal
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from e2e_util import Server, serve, wait_all_free
from grpc_health.v1 import health_pb2
from models import make_tiny_model
from test_chaos import BLOCK, restarted_pid, wait_for
from test_chaos_compose import compose

from pagedserve.blockmgr.manager import BlockManager
from pagedserve.common.config import EngineConfig
from pagedserve.common.messages.frontend import AddRequest
from pagedserve.common.messages.types import SamplingParams
from pagedserve.gpuworker.model_runner import ModelRunner
from pagedserve.scheduler.engine import EngineCore, InProcessBlockClient, InProcessWorkerClient

Job = tuple[list[int], dict[str, Any]]
Outputs = dict[int, list[int]]  # output index -> tokens


def workload() -> list[Job]:
    rng = random.Random(23)
    jobs: list[Job] = []
    for i in range(10):
        prompt = [rng.randrange(1, 400) for _ in range(rng.randint(6, 30))]
        s: dict[str, Any] = dict(max_tokens=rng.randint(70, 110), ignore_eos=True)
        if i < 4:  # seeded parallel sampling: sample j is the request seeded seed + j
            s.update(n=3, temperature=0.9, top_p=0.95, seed=200 + i)
        elif i == 4:
            s.update(n=2, temperature=0.0)
        elif i < 7:  # beam search: nothing streams before the final beams
            s.update(beam_width=3, n=2, temperature=0.0, max_tokens=rng.randint(110, 130))
        elif i % 2:
            s.update(temperature=0.9, seed=300 + i)
        else:
            s.update(temperature=0.0)
        jobs.append((prompt, s))
    return jobs


def num_outputs(s: dict[str, Any]) -> int:
    return int(s.get("n", 1))


def reference(model_dir: str, jobs: list[Job]) -> list[Outputs]:
    cfg = EngineConfig(model=model_dir, block_size=BLOCK, num_gpu_blocks=2000, max_num_seqs=64)
    core = EngineCore(cfg, InProcessBlockClient(lambda i: BlockManager(i.num_gpu_blocks, i.num_cpu_blocks,
                                                                       i.block_size)),
                      InProcessWorkerClient(ModelRunner(cfg)))
    for i, (prompt, s) in enumerate(jobs):
        core.handle(AddRequest(f"r{i}", prompt, SamplingParams(**s), 0.0))
    out: dict[str, Outputs] = {f"r{i}": {} for i in range(len(jobs))}
    for d in core.run_until_idle():
        o = out[d.request_id]
        o[d.index] = (d.token_ids if d.replace else o.get(d.index, []) + d.token_ids)
    return [out[f"r{i}"] for i in range(len(jobs))]


@dataclass
class Stream:
    outputs: Outputs = field(default_factory=dict)
    reasons: dict[int, str] = field(default_factory=dict)
    error: grpc.RpcError | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.outputs.values())


def run_streams(server: Server, jobs: list[Job]) -> tuple[list[Stream], list[threading.Thread]]:
    streams = [Stream() for _ in jobs]

    def one(job: Job, st: Stream) -> None:
        with server.client() as c:
            try:
                for resp in c.stream(job[0], timeout=180, **job[1]):
                    for o in resp.outputs:
                        st.outputs[o.index] = ([] if o.replace else st.outputs.get(o.index, [])) + list(o.token_ids)
                        if o.finish_reason:
                            st.reasons[o.index] = o.finish_reason
            except grpc.RpcError as e:
                st.error = e

    threads = [threading.Thread(target=one, args=(j, s), daemon=True) for j, s in zip(jobs, streams)]
    for t in threads:
        t.start()
    return streams, threads


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[Job], list[Outputs]]:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("chaos_par"), "llama", seed=7, num_hidden_layers=2)
    jobs = workload()
    return model_dir, jobs, reference(model_dir, jobs)


# The scheduler is the case the frontend resumes; after a worker or blockmgr kill the scheduler does.
@pytest.mark.parametrize("mode,victim", [("serve", "scheduler"), ("compose", "scheduler"),
                                         ("serve", "gpuworker"), ("serve", "blockmgr")])
def test_kill_9_resumes_parallel_sampling_and_beam_search(
        setup: tuple[str, list[Job], list[Outputs]], mode: str, victim: str, tmp_path: os.PathLike[str]) -> None:
    model_dir, jobs, expected = setup
    need = sum(num_outputs(s) * -(-(len(p) + s["max_tokens"]) // BLOCK) for p, s in jobs)
    extra = ["--block-size", str(BLOCK), "--num-gpu-blocks", str(need // 2), "--max-num-seqs", "32"]
    sampled = [i for i, (_, s) in enumerate(jobs) if "beam_width" not in s]
    total = sum(num_outputs(jobs[i][1]) * jobs[i][1]["max_tokens"] for i in sampled)
    with ExitStack() as stack:
        if mode == "serve":
            server = stack.enter_context(serve("--model", model_dir, *extra))
        else:
            c = stack.enter_context(compose(model_dir, extra, str(tmp_path) + "/run"))
            server = Server(None, c.addr, c.pids, c.log)  # type: ignore[arg-type]  # what the helpers read
        streams, threads = run_streams(server, jobs)
        wait_for(lambda: sum(s.num_tokens for s in streams) >= total // 4, 90, "a quarter of the tokens")
        os.kill(server.pids[victim], signal.SIGKILL)
        # Taken right after the kill: what had streamed is what the frontend must continue from.
        mid = [i for i in sampled if num_outputs(jobs[i][1]) > 1 and streams[i].num_tokens
               and len(streams[i].reasons) < num_outputs(jobs[i][1])]
        beams_open = [i for i, (_, s) in enumerate(jobs) if "beam_width" in s and not streams[i].reasons]
        if mode == "serve":
            server.pids[victim] = restarted_pid(server, victim)
        else:
            c.procs[victim].wait(10)
            time.sleep(1.0)  # compose's restart delay
            c.start(victim)
        for t in threads:
            t.join(180)
        log = "".join(server.log)
        if mode == "compose":
            try:
                wait_for(lambda: c.health() == health_pb2.HealthCheckResponse.SERVING, 30, "SERVING again")
            except AssertionError:
                print("".join(server.log[-60:]))
                raise
        wait_all_free(server)
    assert mid, "no n > 1 stream was mid-way at the kill"
    assert beams_open, "every beam search had finished before the kill"
    done = r"scheduler back: \d+ requests resumed" if victim == "scheduler" else r"recovered in [\d.]+s"
    assert re.search(done, log), "no recovery in the log"
    if any(s.error for s in streams):
        print(log)  # what each component said, for the error below
    assert [s.error for s in streams] == [None] * len(jobs)
    for i, (st, want) in enumerate(zip(streams, expected)):
        assert st.outputs == want, f"request {i} ({jobs[i][1]}) differs from the undisturbed run"
        assert len(st.reasons) == num_outputs(jobs[i][1]), f"request {i}: not every output finished"
