"""Tensor parallelism 2 on CPU (gloo) against the same worker at TP 1.

Two real ranks run one scripted scenario (this file run as a script: rank 0
drives, rank 1 follows rank 0's broadcasts); the test runs the scenario at
TP 1 in-process and compares: greedy and seeded tokens identical, logits,
logprobs and prompt logprobs within 1e-4, and each rank's KV pool holding
exactly its slice of the TP-1 pool's heads. Families: Llama (GQA, uneven MLP
split, odd vocabulary), GPT-2 (stacked c_attn, biases after the all-reduce,
tied vocab-parallel head), OPT (project_in/out) and Qwen2 with 2 query heads
per rank over one replicated KV head. Then the real ``pagedserve gpuworker -tp 2`` process.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import make_tiny_model  # noqa: E402
from test_worker import BS, GREEDY, Driver, prompts  # noqa: E402

from pagedserve.common.config import EngineConfig  # noqa: E402
from pagedserve.common.messages.types import SamplingParams  # noqa: E402
from pagedserve.gpuworker.model_runner import ModelRunner  # noqa: E402

# family -> (arch, make_tiny_model overrides); head counts divide by 2 (or 2 by them)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),  # 6 q heads / 2 kv heads, intermediate 97, vocab 509
    "gpt2": ("gpt2", {}),  # 4 heads, biases everywhere
    "opt": ("opt", {}),  # 6 heads, ffn 91, project_in/out (replicated) around a 40-wide vocab-parallel embedding
    "qwen2-rep": ("qwen2", {"num_attention_heads": 4, "num_key_value_heads": 1, "hidden_size": 48}),
    # 2 q / 1 kv heads per rank with replicated q/k norms; layer 1 slides over 16
    "qwen3": ("qwen3", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}),
    # the fused qkv_proj / gate_up_proj cut per rank (gate/up 35 / 36 columns); half of each head rotates; window 16
    "phi3": ("phi3", {"partial_rotary_factor": 0.5, "sliding_window": 16}),
    "gpt_oss": ("gpt_oss", {"intermediate_size": 37}),  # 2 heads + their sinks per rank, experts' columns 18 / 19
    # experts' columns 14 / 15 per rank; layer 0 a dense MLP (35 / 36)
    "qwen3_moe": ("qwen3_moe", {"moe_intermediate_size": 29, "mlp_only_layers": [0]}),
    "mixtral": ("mixtral", {}),  # experts' columns 18 / 18; 28-token sequences cross the window of 24
    # 2 q / 1 kv heads per rank, replicated q/k norms, MLP 35 / 36; 5 layers slide over 16; capped gathered logits
    "gemma3": ("gemma3", {"final_logit_softcapping": 3.0}),
}
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, logprobs=3)
SCORED = SamplingParams(temperature=0.0, prompt_logprobs=2, logprobs=2)


def scenario(runner: ModelRunner) -> dict[str, Any]:
    """Chunked prefill, decodes across block boundaries, a finished sequence,
    a reset: everything the ranks must do in lockstep. Returns what rank 0 saw."""
    d = Driver(runner)
    ps = prompts(4, [9, 20, 5, 6], seed=21)
    out: dict[str, Any] = {"prompt_logprobs": [], "logprobs": [], "logits": []}

    def record(res: Any) -> None:
        out["prompt_logprobs"] += [[p.seq_id, p.start, p.entries] for p in res.prompt_logprobs]
        out["logprobs"] += [[t.seq_id, t.logprob, t.top_logprobs] for t in res.sampled if t.logprob is not None]
        out["logits"].append({str(k): v.tolist() for k, v in runner.last_logits.items()})

    record(d.step({0: 9, 1: 12, 3: 6}, new={0: (ps[0], GREEDY), 1: (ps[1], SCORED), 3: (ps[3], SEEDED)}))
    record(d.step({0: 1, 1: 8, 2: 5, 3: 1}, new={2: (ps[2], GREEDY)}))
    for _ in range(5):
        record(d.step({i: 1 for i in range(4)}))
    record(d.step({1: 1, 2: 1, 3: 1}, finished=[0]))
    out["tokens"] = {str(k): v for k, v in d.tokens.items()}
    runner.reset()
    d = Driver(runner)
    d.step({7: 5}, new={7: (ps[2], GREEDY)})
    d.step({7: 1})
    out["after_reset"] = d.tokens[7]
    out["pool_k"] = runner.cache.gpu[0][0].clone()  # the state the followers end in too
    out["pool_v"] = runner.cache.gpu[-1][1].clone()
    return out


def _config(folder: str, tp: int) -> EngineConfig:
    return EngineConfig(model=folder, device="cpu", dtype="float32", block_size=BS, num_gpu_blocks=48,
                        tensor_parallel_size=tp)


def _rank_main(rank: int, port: int, root: str, out_dir: str) -> None:
    """One rank of the TP-2 run, all families over one process group."""
    from safetensors.torch import save_file

    from pagedserve.common.messages import worker as wk
    from pagedserve.gpuworker.distributed import init_group

    torch.set_num_threads(1)
    tp = init_group(rank, 2, torch.device("cpu"), port=port)
    for family, (arch, overrides) in FAMILIES.items():
        runner = ModelRunner(_config(make_tiny_model(root, arch, seed=3, **overrides), 2), tp, keep_logits=True)
        runner.init()
        if rank == 0:
            out = scenario(runner)
            save_file({"k": out.pop("pool_k"), "v": out.pop("pool_v")}, f"{out_dir}/{family}-rank0.safetensors")
            Path(f"{out_dir}/{family}.json").write_text(json.dumps(out))
            tp.send_request(wk.Shutdown())  # this family is done
        else:
            runner.follow()
            save_file({"k": runner.cache.gpu[0][0], "v": runner.cache.gpu[-1][1]}, f"{out_dir}/{family}-rank1.safetensors")
    tp.destroy()
    # Everything is written: skip the interpreter's teardown, where a rank aborted in native code
    # ("terminate called without an active exception", twice in one fresh-clone suite run with ten
    # families) after its last file was saved; the components end the same way (cli._quiet_exit).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.fixture(scope="module")
def tp2_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    root = str(tmp_path_factory.mktemp("tp-models"))
    out_dir = tmp_path_factory.mktemp("tp-out")
    for arch, overrides in FAMILIES.values():
        make_tiny_model(root, arch, seed=3, **overrides)  # written once, before the ranks read them
    from pagedserve.gpuworker.distributed import create_store

    def run_group() -> list[tuple[int, str]]:
        store = create_store(2)
        procs = [
            subprocess.Popen([sys.executable, __file__, str(r), str(store.port), root, str(out_dir)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for r in range(2)
        ]
        try:
            logs = [p.communicate(timeout=240)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        del store
        return [(p.returncode, log) for p, log in zip(procs, logs)]

    ranks = run_group()
    # A rank aborted in native code with no Python error ("terminate called without an
    # active exception", once in a fresh-clone suite run, not reproduced in 12 runs
    # alone): the group is run once more, and both logs are shown.
    if any(rc == -6 and "Traceback" not in log for rc, log in ranks):
        print("test_tp: a rank aborted (SIGABRT) without a Python error; running the group again:\n"
              + "\n".join(f"rank {r}: rc {rc}: {log[-2000:]}" for r, (rc, log) in enumerate(ranks)))
        ranks = run_group()
    for rc, log in ranks:
        assert rc == 0, log
    return root, out_dir


def _close(a: Any, b: Any, tol: float = 1e-4) -> None:
    """Nested lists of numbers / (id, value) pairs: same structure and ids, values within tol."""
    if isinstance(a, float) or isinstance(b, float):
        assert abs(a - b) <= tol, (a, b)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), (a, b)
        for x, y in zip(a, b):
            _close(x, y, tol)
    else:
        assert a == b


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tp2_matches_tp1_and_each_rank_holds_only_its_heads(family: str, tp2_run: tuple[str, Path]) -> None:
    from safetensors.torch import load_file

    root, out_dir = tp2_run
    arch, overrides = FAMILIES[family]
    ref_runner = ModelRunner(_config(make_tiny_model(root, arch, seed=3, **overrides), 1), keep_logits=True)
    ref_runner.init()
    ref = scenario(ref_runner)
    got = json.loads((out_dir / f"{family}.json").read_text())
    assert got["tokens"] == ref["tokens"] and got["after_reset"] == ref["after_reset"]
    assert len(set(ref["tokens"]["3"][6:])) > 1  # the seeded row really sampled
    assert ref["prompt_logprobs"] and ref["logprobs"]
    _close(got["prompt_logprobs"], ref["prompt_logprobs"])
    _close(got["logprobs"], ref["logprobs"])
    for g, r in zip(got["logits"], ref["logits"]):
        assert g.keys() == r.keys()
        for k in r:
            scale = max(abs(x) for x in r[k])
            assert max(abs(x - y) for x, y in zip(g[k], r[k])) / scale < 1e-4
    total_kv = ref_runner.num_kv_heads
    local = max(1, total_kv // 2)
    for rank in range(2):
        pools = load_file(str(out_dir / f"{family}-rank{rank}.safetensors"))
        first = rank * total_kv // 2 if total_kv >= 2 else 0  # one KV head: both ranks keep it
        for name, full in (("k", ref["pool_k"]), ("v", ref["pool_v"])):
            assert pools[name].shape == (48, BS, local, ref_runner.head_dim)
            torch.testing.assert_close(pools[name], full[:, :, first : first + local], rtol=1e-4, atol=1e-5)


def test_heads_that_do_not_split_are_refused(tmp_path: Path) -> None:
    from pagedserve.gpuworker.distributed import TPGroup
    from pagedserve.gpuworker.loader import iter_weights, load_hf_config
    from pagedserve.gpuworker.models import build_model

    folder = make_tiny_model(tmp_path, "qwen2", seed=0)  # 7 query heads
    with pytest.raises(ValueError, match="num_attention_heads 7 is not divisible by tensor_parallel_size 2"):
        build_model(load_hf_config(folder), iter_weights(folder, progress=False), torch.float32, torch.device("cpu"),
                    512, TPGroup(0, 2))


def _tp_ranks_of(addr: str) -> list[int]:
    """Pids of processes started as a rank of the worker serving ``addr``."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"--tp-rank" in cmd and addr.encode() in cmd:
                pids.append(int(entry))
    return pids


def test_gpuworker_process_starts_its_ranks_and_stops_them(tmp_path: Path) -> None:
    import zmq

    from pagedserve.common.ipc import ReqClient
    from pagedserve.common.messages import worker as wk

    folder = make_tiny_model(tmp_path, "llama", seed=3)
    addr = f"ipc://{tmp_path}/worker.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedserve", "gpuworker", "--model", folder, "-tp", "2", "--num-gpu-blocks", "32",
         "--block-size", str(BS), "--worker-addr", addr],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    ctx = zmq.Context()
    client: ReqClient[wk.Reply] = ReqClient(ctx, addr, wk.Reply)
    try:
        ready = client.call(wk.InitWorker(), timeout_s=120)
        assert isinstance(ready, wk.WorkerReady), ready
        assert ready.num_gpu_blocks == 32 and ready.model.num_kv_heads == 2
        assert len(_tp_ranks_of(addr)) == 1
        prompt = prompts(1, [11], seed=5)[0]
        ref = ModelRunner(_config(folder, 1), keep_logits=True)
        ref.init()
        tokens_ref, tokens = [], []
        for runner_tokens, call in ((tokens_ref, ref.execute), (tokens, lambda s: client.call(s, timeout_s=60))):
            step = wk.ExecuteStep(1, [wk.NewSeq(1, prompt, 0, GREEDY, 11)], [wk.BlockDiff(1, 0, [5, 9])], [wk.ScheduledSeq(1, 11)], [])
            for i in range(4):
                res = call(step)
                assert isinstance(res, wk.StepResult), res
                runner_tokens.append(res.sampled[0].token_id)
                step = wk.ExecuteStep(i + 2, [], [], [wk.ScheduledSeq(1, 1)], [])
        assert tokens == tokens_ref
        bad = client.call(wk.ExecuteStep(9, [], [], [wk.ScheduledSeq(42, 1)], []), timeout_s=30)
        assert isinstance(bad, wk.WorkerError) and "unknown seq 42" in bad.message  # and the group survives it:
        assert isinstance(client.call(wk.ExecuteStep(10, [], [], [wk.ScheduledSeq(1, 1)], []), timeout_s=30), wk.StepResult)
    finally:
        client.close()
        ctx.term()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    deadline = time.monotonic() + 10
    while _tp_ranks_of(addr) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _tp_ranks_of(addr), out
    assert "tensor parallel 2 (1 of 2 KV heads per rank)" in out


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
