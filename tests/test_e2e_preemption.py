"""Issue 5, acceptance 2: 200 concurrent greedy requests through the real four
processes with a KV pool that holds about 10% of the workload's KV, in swap
and in recompute mode: all complete, token-identical to an unconstrained run,
and every GPU and CPU block is free afterwards."""
from __future__ import annotations

import random
import time

import pytest
from e2e_util import Server, serve
from models import make_tiny_model

from pagedserve.blockmgr.manager import BlockManager
from pagedserve.common.config import EngineConfig
from pagedserve.common.messages.frontend import AddRequest
from pagedserve.common.messages.types import SamplingParams
from pagedserve.gpuworker.model_runner import ModelRunner
from pagedserve.scheduler.engine import EngineCore, InProcessBlockClient, InProcessWorkerClient

BLOCK = 8
N_REQ = 200


def workload(vocab: int = 400) -> list[tuple[list[int], int]]:
    rng = random.Random(5)
    return [([rng.randrange(1, vocab) for _ in range(rng.randint(4, 24))], rng.randint(4, 16)) for _ in range(N_REQ)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[tuple[list[int], int]], list[list[int]]]:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("pre"), "llama", seed=4, num_hidden_layers=2)
    jobs = workload()
    # The unconstrained reference: the same engine core in-process with a pool that holds everything.
    cfg = EngineConfig(model=model_dir, block_size=BLOCK, num_gpu_blocks=4000, max_num_seqs=256)
    core = EngineCore(cfg, InProcessBlockClient(lambda i: BlockManager(i.num_gpu_blocks, i.num_cpu_blocks,
                                                                       i.block_size)),
                      InProcessWorkerClient(ModelRunner(cfg)))
    for i, (p, n) in enumerate(jobs):
        core.handle(AddRequest(f"r{i}", p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), 0.0))
    ref: dict[str, list[int]] = {}
    for d in core.run_until_idle():
        ref[d.request_id] = ref.get(d.request_id, []) + d.token_ids
    assert core.scheduler.num_preemptions == 0
    return model_dir, jobs, [ref[f"r{i}"] for i in range(N_REQ)]


def total_blocks(jobs: list[tuple[list[int], int]]) -> int:
    return sum(-(-(len(p) + n) // BLOCK) for p, n in jobs)


def run_all(server: Server, jobs: list[tuple[list[int], int]]) -> list[list[int]]:
    import concurrent.futures

    def one(job: tuple[list[int], int]) -> list[int]:
        with server.client() as c:
            ids, _, reason = c.generate(job[0], max_tokens=job[1], temperature=0.0, ignore_eos=True, timeout=600)
            assert reason == "length"
            return ids

    with concurrent.futures.ThreadPoolExecutor(max_workers=N_REQ) as pool:
        return list(pool.map(one, jobs))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_200_requests_in_a_pool_of_10_percent(setup: tuple[str, list[tuple[list[int], int]], list[list[int]]],
                                              mode: str) -> None:
    model_dir, jobs, expected = setup
    pool = total_blocks(jobs) // 10
    assert pool * BLOCK >= max(len(p) + n for p, n in jobs) + BLOCK
    extra = ["--swap-space", "0.002"] if mode == "swap" else []
    with serve("--model", model_dir, "--block-size", str(BLOCK), "--num-gpu-blocks", str(pool + 1),
               "--max-num-seqs", "256", "--preemption-mode", mode, *extra) as server:
        got = run_all(server, jobs)
        with server.client() as c:
            deadline = time.monotonic() + 20
            while (info := c.server_info()).num_free_gpu_blocks != info.num_gpu_blocks and time.monotonic() < deadline:
                time.sleep(0.1)

    assert got == expected
    assert info.num_free_gpu_blocks == info.num_gpu_blocks == pool
    assert info.num_free_cpu_blocks == info.num_cpu_blocks
    assert info.num_running == info.num_waiting == info.num_swapped == 0
    if mode == "swap":
        assert info.num_cpu_blocks > 0
