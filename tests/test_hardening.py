"""Fuzzed frames on every internal socket of the real four processes (tiny
Llama, real model worker): garbage, wrong tags, wrong field types, several
parts, other channels' messages, invalid requests, raw non-ZMTP bytes. Nothing
crashes, the requests in flight finish with the tokens they get without the
fuzz, every block comes back, and each component counts what it dropped."""
from __future__ import annotations

import glob
import os
import random
import re
import socket
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from e2e_util import Server, free_port, serve, wait_all_free
from models import make_tiny_model
from pagedserve.common.messages import blockmgr as bm
from pagedserve.common.messages import frontend as fe
from pagedserve.common.messages import worker as wk
from pagedserve.common.messages.types import SamplingParams

PROMPTS = ["The quick brown fox", "Hello", "A paged KV cache stores keys and values in fixed-size blocks",
           "Once upon a time"]
MAX_TOKENS = 120
FUZZ_FRAMES = 400  # per socket
COMPONENTS = ("frontend", "scheduler", "blockmgr", "gpuworker")

enc = msgspec.msgpack.encode


def garbage_frames(rng: random.Random) -> list[list[bytes]]:
    """One message per entry (a list of parts); none decodes on the worker or blockmgr socket."""
    frames: list[list[bytes]] = [
        [b""], [b"\xc1"], [b"\xff" * 64], [enc([])], [enc([999, 1, 2])], [enc("not an array")],
        [enc([1, "seq", None])],  # Allocate's tag with wrong field types
        [enc([30, "x", {}, None])],  # ExecuteStep's tag, wrong fields
        [enc([50, 7, "x"])],  # AddRequest's tag, wrong fields
        [enc(fe.Outputs([]))], [enc(bm.Ack())], [enc(wk.WorkerAck())],  # other channels' messages
        [enc(fe.StatsQuery(3))],
        [b"a", b"b"], [enc(fe.StatsQuery(1)), enc(fe.StatsQuery(2))],  # several parts
    ]
    for _ in range(20):
        frames.append([rng.randbytes(rng.randint(1, 300))])
        frames.append([enc([rng.choice([1, 2, 3, 20, 22, 30, 40, 50, 51, 52, 60, 61]),
                            *[rng.choice([None, -1, 2**63, "x", [1.5], {"a": 1}]) for _ in range(rng.randint(0, 6))]])])
    return frames


def invalid_adds() -> list[list[bytes]]:
    """Well-typed AddRequests the scheduler must refuse itself (the frontend never sends them)."""
    sp = SamplingParams(max_tokens=4)
    return [[enc(fe.AddRequest(f"fuzz-{i}", ids, p, 0.0))] for i, (ids, p) in enumerate([
        ([], sp), ([10**6], sp), ([-5, 3], sp), ([1, 2], SamplingParams(max_tokens=0)),
        ([1, 2], SamplingParams(n=0)), ([1, 2], SamplingParams(temperature=float("nan"))),
        ([1, 2], SamplingParams(logit_bias={10**7: 1.0})), ([1, 2], SamplingParams(top_p=0.0)),
        ([1] * 10_000, sp),
    ])]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, dict[str, int]]]:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("models"), "llama", seed=0)
    ports = {c: free_port() for c in COMPONENTS}
    env = {f"PAGEDSERVE_{c.upper()}_METRICS_PORT": str(p) for c, p in ports.items()}
    with serve("--model", model_dir, "--num-gpu-blocks", "128", "--max-model-len", "512", env=env) as s:
        yield s, ports


def run_dir(s: Server) -> Path:
    found = glob.glob(os.path.join(tempfile.gettempdir(), f"pagedserve-run-{s.proc.pid}-*"))
    assert found, "no run directory"
    return Path(max(found, key=os.path.getmtime))  # the newest: an older one is a reused pid's


def dropped(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^pagedserve:dropped_frames_total\{socket="([^"]+)"\} (\S+)$', text, re.M)}


def generate_all(s: Server) -> list[list[int]]:
    out: list[list[int] | BaseException] = [[] for _ in PROMPTS]

    def one(i: int) -> None:
        try:
            with s.client() as c:
                out[i] = c.generate(PROMPTS[i], max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                    timeout=120)[0]
        except BaseException as e:  # noqa: BLE001 - reported below
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for r in out:
        assert not isinstance(r, BaseException), f"{r}\n{''.join(s.log[-30:])}"
    return out  # type: ignore[return-value]


def fuzz(rd: Path, stop: threading.Event, counts: dict[str, int]) -> None:
    rng = random.Random(11)
    ctx = zmq.Context()
    frames = garbage_frames(rng)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(f"ipc://{rd}/scheduler_in.sock")
    reqs = {name: ctx.socket(zmq.REQ) for name in ("blockmgr", "worker")}
    for name, r in reqs.items():
        r.setsockopt(zmq.LINGER, 0)
        r.setsockopt(zmq.REQ_RELAXED, 1)
        r.connect(f"ipc://{rd}/{name}.sock")
    replies = {"blockmgr": msgspec.msgpack.Decoder(bm.Reply), "worker": msgspec.msgpack.Decoder(wk.Reply)}
    try:
        for i in range(FUZZ_FRAMES):
            if stop.is_set():
                break
            msg = frames[i % len(frames)]
            push.send_multipart(msg)
            push.send_multipart(invalid_adds()[i % 9])
            counts["scheduler_in"] += 2
            for name, r in reqs.items():
                r.send_multipart(msg)
                assert r.poll(10_000), f"{name} did not answer a bad frame"
                reply = replies[name].decode(r.recv())
                assert isinstance(reply, (bm.ErrorReply, wk.WorkerError)) and reply.kind == "bad_frame", reply
                counts[name] += 1
            if i % 10 == 0:  # well-formed commands from a peer that does not own the session
                for name, cmd in (("blockmgr", bm.ResetRequest()), ("blockmgr", bm.InitRequest(8, 0, 16, True)),
                                  ("worker", wk.ResetWorker()), ("worker", wk.Shutdown())):
                    reqs[name].send(enc(cmd))
                    assert reqs[name].poll(10_000)
                    reply = replies[name].decode(reqs[name].recv())
                    assert isinstance(reply, (bm.ErrorReply, wk.WorkerError)) and reply.kind == "wrong_peer", reply
                    counts[name] += 1
            if i % 20 == 0:  # raw bytes that are not ZMTP at all, on every socket file
                for path in rd.glob("*.sock"):
                    with socket.socket(socket.AF_UNIX) as u:
                        u.connect(str(path))
                        u.sendall(rng.randbytes(64))
    finally:
        ctx.destroy(linger=0)


def test_fuzzed_frames_on_every_internal_socket(server: tuple[Server, dict[str, int]]) -> None:
    s, ports = server
    reference = generate_all(s)
    stop = threading.Event()
    counts = {"scheduler_in": 0, "blockmgr": 0, "worker": 0}
    errors: list[BaseException] = []

    def fuzzer() -> None:
        try:
            while not stop.is_set():
                fuzz(run_dir(s), stop, counts)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=fuzzer)
    t.start()
    try:
        time.sleep(0.5)  # fuzz from before the requests arrive until after they end
        during = generate_all(s)
    finally:
        stop.set()
        t.join(60)
    assert not errors, errors
    assert during == reference  # same tokens as without the fuzz
    assert all(len(r) == MAX_TOKENS for r in during)
    assert all(counts[k] > 20 for k in counts), counts
    for name, pid in s.pids.items():
        assert s.proc.poll() is None and os.path.exists(f"/proc/{pid}"), f"{name} died"
    wait_all_free(s)
    assert dropped(ports["scheduler"]).get("scheduler_in", 0) >= 20
    assert dropped(ports["blockmgr"]).get("blockmgr", 0) >= counts["blockmgr"] * 0.9
    assert dropped(ports["gpuworker"]).get("worker", 0) >= counts["worker"] * 0.9
    # Logged, but rate-limited: not one line per frame.
    lines = [ln for ln in s.log if "dropped a malformed frame" in ln]
    assert 0 < len(lines) < 40, len(lines)
    with s.client() as c:  # still serving
        assert c.generate(PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)[0] == reference[0]
