"""Issue 19, stream integrity: the scheduler numbers its Outputs; a frame lost
on the way (here: taken by a second reader on the scheduler's output socket,
which ZeroMQ's PUSH serves round-robin) ends the open streams with
DATA_LOSS, never with a short output and status OK. Real processes, real
gRPC client, real ZeroMQ thief."""
from __future__ import annotations

import threading
import time
from typing import Any

import grpc
import msgspec
import pytest
import zmq
from e2e_util import Server, serve, wait_all_free
from models import make_tiny_model

from pagedserve.common.messages import frontend as fe
from pagedserve.frontend.core.engine_client import FrameCheck


def test_frame_check_counts_gaps_and_restarts_per_epoch() -> None:
    def out(epoch: int, seq: int) -> fe.Outputs:
        return fe.Outputs([], epoch, seq)

    def stats(epoch: int, sent: int) -> fe.EngineStats:
        return fe.EngineStats(1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, epoch=epoch, outputs_sent=sent)

    fc = FrameCheck()
    assert fc.missing(out(7, 12)) == 0  # a frontend started beside a running scheduler
    assert fc.missing(out(7, 13)) == 0
    assert fc.missing(out(7, 16)) == 2
    assert fc.missing(out(7, 17)) == 0
    assert fc.missing(stats(7, 18)) == 0  # sent after frame 17: nothing missing
    assert fc.missing(stats(7, 20)) == 2  # frames 18 and 19 (the last ones) went elsewhere
    assert fc.missing(out(7, 20)) == 0
    assert fc.missing(out(9, 0)) == 0  # a restarted scheduler starts again from 0
    assert fc.missing(out(9, 1)) == 0
    assert fc.missing(out(5, 3)) == 3  # another one whose first three frames went elsewhere
    assert fc.missing(out(0, 0)) == 0  # unnumbered


def scheduler_out(server: Server) -> str:
    with open(f"/proc/{server.pids['scheduler']}/cmdline", "rb") as f:
        argv = f.read().decode().split("\0")
    return argv[argv.index("--scheduler-out") + 1]


def stream(server: Server, prompt: list[int], results: list[Any], i: int) -> None:
    tokens: list[int] = []
    reason = ""
    try:
        with server.client() as c:
            for resp in c.stream(prompt, timeout=60, max_tokens=60, ignore_eos=True, temperature=0.0):
                for o in resp.outputs:
                    tokens += o.token_ids
                    reason = o.finish_reason or reason
        results[i] = ("ok", len(tokens), reason)
    except grpc.RpcError as e:
        results[i] = (e.code(), len(tokens), e.details())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("integrity"), "llama", seed=3, num_hidden_layers=2)


def test_stolen_frames_end_streams_with_an_error(model_dir: str) -> None:
    with serve("--model", model_dir, "--block-size", "8", "--num-gpu-blocks", "200",
               env={"PAGEDSERVE_HEALTH_INTERVAL": "0.3"}) as server:
        ctx = zmq.Context()
        thief = ctx.socket(zmq.PULL)
        thief.connect(scheduler_out(server))
        stolen: list[bytes] = []
        done = threading.Event()

        def steal() -> None:
            while not done.is_set():
                if thief.poll(50):
                    stolen.append(thief.recv())

        t = threading.Thread(target=steal, daemon=True)
        t.start()
        time.sleep(0.5)  # the thief's pipe is attached before the streams start
        results: list[Any] = [None] * 3
        threads = [threading.Thread(target=stream, args=(server, [5 + i, 9, 11, 13], results, i)) for i in range(3)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(90)
        done.set()
        t.join(5)
        thief.close(linger=0)
        ctx.term()
        outs = [msgspec.msgpack.decode(b, type=fe.Reply) for b in stolen]
        took = sum(len(d.token_ids) for o in outs if isinstance(o, fe.Outputs) for d in o.deltas)
        assert took > 0, "the thief took no output frame: the test proves nothing"
        # Every stream lost frames to the thief: none may end OK with a short output.
        for code, n, detail in results:
            assert code == grpc.StatusCode.DATA_LOSS, (code, n, detail)
        # The thief is gone. A stats answer that reaches the frontend now shows
        # the frames it took after the streams ended (GetServerInfo asks afresh;
        # the watchdog may still wait out a query the thief took); then whole
        # streams are served again.
        with server.client() as c:
            c.server_info()
        again: list[Any] = [None]
        stream(server, [1, 2, 3], again, 0)
        assert again[0] == ("ok", 60, "length")
        wait_all_free(server)
