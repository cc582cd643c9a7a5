"""The scheduler process honours SIGTERM while it waits on a worker that does
not answer (it used to sit out the whole --init-timeout / --step-timeout)."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import zmq

from pagedserve.common.messages import worker as wk


def test_sigterm_ends_a_wait_on_a_silent_worker_at_once(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    ctx: zmq.Context = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # takes requests, never answers
    silent.bind(f"ipc://{run}/worker.sock")
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve", "scheduler", "--worker", "sim",
                             "--scheduler-in", f"ipc://{run}/in.sock", "--scheduler-out", f"ipc://{run}/out.sock",
                             "--blockmgr-addr", f"ipc://{run}/blockmgr.sock", "--worker-addr", f"ipc://{run}/worker.sock",
                             "--init-timeout", "1800"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert silent.poll(60_000), "the scheduler never asked the worker"
        parts = silent.recv_multipart()
        assert isinstance(msgspec.msgpack.decode(parts[-1], type=wk.Request), wk.InitWorker)
        time.sleep(0.5)  # well inside the wait
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(10)
        assert time.monotonic() - t0 < 3.0
        assert rc == 0, proc.stdout.read() if proc.stdout else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        ctx.destroy(linger=0)
