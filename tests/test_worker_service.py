"""The gpuworker process over its real ZeroMQ socket: init, steps, errors that
do not kill it, reset, and a clean exit on SIGTERM that removes the socket."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import zmq
from models import make_tiny_model

from pagedserve.common.ipc import ReqClient
from pagedserve.common.messages import worker as wk
from pagedserve.common.messages.types import SamplingParams


def test_worker_process_serves_steps_and_exits_cleanly(tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path, "llama", seed=0)
    sock = tmp_path / "run" / "worker.sock"
    addr = f"ipc://{sock}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedserve", "gpuworker", "--model", folder, "--num-gpu-blocks", "32",
         "--block-size", "8", "--worker-addr", addr],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    ctx = zmq.Context()
    client: ReqClient[wk.Reply] = ReqClient(ctx, addr, wk.Reply)
    try:
        ready = client.call(wk.InitWorker(), timeout_s=120)
        assert isinstance(ready, wk.WorkerReady), ready
        assert ready.num_gpu_blocks == 32 and ready.block_size == 8 and ready.model.vocab_size == 509
        greedy = SamplingParams(temperature=0.0)
        step = wk.ExecuteStep(1, [wk.NewSeq(7, [5, 6, 7, 8, 9], 0, greedy, 5)], [wk.BlockDiff(7, 0, [3])], [wk.ScheduledSeq(7, 5)], [])
        res = client.call(step, timeout_s=30)
        assert isinstance(res, wk.StepResult) and [t.seq_id for t in res.sampled] == [7]
        # An unknown sequence is an error reply, not a crash.
        bad = client.call(wk.ExecuteStep(2, [], [], [wk.ScheduledSeq(99, 1)], []), timeout_s=30)
        assert isinstance(bad, wk.WorkerError) and "unknown seq 99" in bad.message
        res = client.call(wk.ExecuteStep(3, [], [], [wk.ScheduledSeq(7, 1)], []), timeout_s=30)
        assert isinstance(res, wk.StepResult) and len(res.sampled) == 1
        assert isinstance(client.call(wk.ResetWorker(), timeout_s=30), wk.WorkerAck)
        gone = client.call(wk.ExecuteStep(4, [], [], [wk.ScheduledSeq(7, 1)], []), timeout_s=30)
        assert isinstance(gone, wk.WorkerError)
    finally:
        client.close()
        ctx.term()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert not os.path.exists(sock)


def test_unsupported_architecture_fails_at_start(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["BertModel"], "model_type": "bert"}')
    proc = subprocess.run(
        [sys.executable, "-m", "pagedserve", "gpuworker", "--model", str(tmp_path), "--worker-addr",
         f"ipc://{tmp_path}/w.sock"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1
    assert "unsupported architecture" in proc.stderr and "LlamaForCausalLM" in proc.stderr
