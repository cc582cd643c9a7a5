"""The blockmgr process over real ZeroMQ IPC: same answers as in-process,
errors answered instead of crashing, clean exit on SIGTERM."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest
import zmq

from pagedserve.blockmgr.manager import BlockManager
from pagedserve.common.ipc import ReqClient
from pagedserve.common.messages.blockmgr import (
    Ack,
    Allocate,
    Append,
    BlockStats,
    ErrorReply,
    Fork,
    Free,
    InitRequest,
    Reply,
    ResetRequest,
    StatsRequest,
    StepReply,
    StepRequest,
    SwapIn,
    SwapOut,
)


@pytest.fixture()
def blockmgr_proc() -> Iterator[tuple[subprocess.Popen, ReqClient, str]]:
    run_dir = tempfile.mkdtemp(prefix="bm-test-")
    sock = os.path.join(run_dir, "blockmgr.sock")
    addr = f"ipc://{sock}"
    proc = subprocess.Popen([sys.executable, "-m", "pagedserve", "blockmgr", "--blockmgr-addr", addr],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    ctx = zmq.Context()
    client: ReqClient = ReqClient(ctx, addr, Reply)
    try:
        yield proc, client, sock
    finally:
        client.close()
        ctx.term()
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def test_process_matches_in_process_and_survives_errors(blockmgr_proc) -> None:
    proc, c, sock = blockmgr_proc
    # the first call also waits for the process to start
    r = c.call(StepRequest([Allocate(1, [1, 2, 3], 3)]), timeout_s=30)
    assert isinstance(r, ErrorReply) and "not initialised" in r.message
    assert c.call(InitRequest(17, 4, 4), timeout_s=5) == Ack()
    local = BlockManager(17, 4, 4)
    steps = [
        [Allocate(1, list(range(10)), 10), Allocate(2, list(range(50, 55)), 5)],
        [Allocate(3, list(range(10)), 10), Fork(1, 4), Append(1, [7]), Append(4, [8])],
        [SwapOut([1, 4]), Append(2, [1, 2, 3, 4])],
        [Free(2), SwapIn([1, 4])],
    ]
    for ops in steps:
        got = c.call(StepRequest(ops), timeout_s=5)
        assert isinstance(got, StepReply)
        assert got == local.step(StepRequest(ops))
    assert got.stats.prefix_cache_hits == 2 and got.copies == []
    # a protocol error and a malformed frame are answered; the process keeps serving
    r = c.call(StepRequest([Append(99, [1])]), timeout_s=5)
    assert isinstance(r, ErrorReply) and "unknown seq_id 99" in r.message
    c.sock.send(b"\xc1not msgpack")
    assert c.sock.poll(5000)
    assert isinstance(c._decoder.decode(c.sock.recv()), ErrorReply)
    st = c.call(StatsRequest(), timeout_s=5)
    assert isinstance(st, BlockStats) and st.num_seqs == 3 and st.num_gpu_blocks == 16
    assert c.call(ResetRequest(), timeout_s=5) == Ack()
    st = c.call(StatsRequest(), timeout_s=5)
    assert (st.num_seqs, st.num_free_gpu_blocks, st.prefix_cache_queries) == (0, 16, 0)
    # SIGTERM: clean exit, ipc socket file removed
    assert os.path.exists(sock)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0
    assert not os.path.exists(sock)


CALLER = """
import sys, zmq
from pagedserve.common.ipc import ChannelTimeout, ReqClient
from pagedserve.common.messages.blockmgr import InitRequest, Reply, StatsRequest
c = ReqClient(zmq.Context(), sys.argv[1], Reply)
c.call(InitRequest(17, 4, 4), timeout_s=30)
print("ready", flush=True)
sys.stdin.readline()
try:
    print(type(c.call(StatsRequest(), timeout_s=2.0)).__name__, flush=True)
except ChannelTimeout as e:
    print("ChannelTimeout", e, flush=True)
"""


def test_a_caller_stopped_past_its_deadline_waits_for_its_peer_resumed_with_it(blockmgr_proc) -> None:
    """A benchmark that pauses an engine (SIGSTOP to each process), a paused VM:
    the caller and its peer both stop while a request is out, for longer than
    its 2 s timeout, and the caller resumes first. The time neither ran is not
    held against the peer: the reply that comes once it resumes is taken,
    instead of a timeout that would recover by recompute and drop the prefix
    cache (the slow warm round of the 2026-12-04 fp32 bench peers run)."""
    proc, _, sock = blockmgr_proc
    caller = subprocess.Popen([sys.executable, "-c", CALLER, f"ipc://{sock}"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert caller.stdout is not None and caller.stdin is not None
        assert caller.stdout.readline().strip() == "ready"
        os.kill(proc.pid, signal.SIGSTOP)  # the peer stops first, before it answers
        caller.stdin.write("\n")
        caller.stdin.flush()
        time.sleep(0.5)  # the request is out, the caller polls for its reply
        os.kill(caller.pid, signal.SIGSTOP)
        time.sleep(3.0)  # past the caller's 2 s deadline
        os.kill(caller.pid, signal.SIGCONT)
        time.sleep(0.5)  # the caller runs again before its peer does
        os.kill(proc.pid, signal.SIGCONT)
        assert caller.stdout.readline().strip() == "BlockStats"
        assert caller.wait(10) == 0
        # A peer that stays silent while the caller runs still times out.
        caller = subprocess.Popen([sys.executable, "-c", CALLER, f"ipc://{sock}"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert caller.stdout is not None and caller.stdin is not None
        assert caller.stdout.readline().strip() == "ready"
        os.kill(proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        caller.stdin.write("\n")
        caller.stdin.flush()
        assert caller.stdout.readline().startswith("ChannelTimeout")
        assert 1.9 < time.monotonic() - t0 < 10
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        if caller.poll() is None:
            caller.kill()
        caller.wait(5)
