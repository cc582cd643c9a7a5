"""The Kubernetes path's endpoint picker (pagedserve/kvpicker.py, issue 42 acceptance 4), without
podman: its index is fed the event batches our blockmgr's own manager makes (encoded as its
publisher sends them), its hashes are compared with the ones the blockmgr publishes for the same
tokens (under the pods' PYTHONHASHSEED=42, in a fresh interpreter), and each choice is asserted
as an exact pod. The transport part reads a real KVEventPublisher over tcp, a gap filled by replay."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import msgspec
import pytest
import zmq

from pagedserve.blockmgr.kv_events import KVEventBatch
from pagedserve.blockmgr.kv_publisher import KVEventPublisher
from pagedserve.blockmgr.manager import BlockManager
from pagedserve.common.block_hash import NONE_HASH
from pagedserve.common.kv_events_config import KVEventsConfig
from pagedserve.kvpicker import EventReader, Picker, Pod, PodIndex, block_hashes

BS = 4
SEED = os.environ.get("PYTHONHASHSEED") or "vllm-none-hash"  # what this process's blockmgr hashes from


class Engine:
    """A blockmgr's manager, driven as the scheduler drives it: each step's events encoded as published."""

    def __init__(self, blocks: int = 9) -> None:
        self.mgr = BlockManager(num_gpu_blocks=blocks, num_cpu_blocks=0, block_size=BS, kv_events=True)
        self.seq = 0
        self._next_id = 1

    def batch(self) -> bytes | None:
        b = self.mgr.take_kv_events()
        return None if b is None else msgspec.msgpack.Encoder().encode(b)

    def run(self, tokens: list[int], free: bool = True) -> list[bytes]:
        """A request with this prompt, prefilled in one step; the batches that came of it."""
        out = [b for b in [self.batch()] if b]
        sid, self._next_id = self._next_id, self._next_id + 1
        self.mgr.begin_step()
        self.mgr.allocate(sid, tokens, len(tokens))
        self.mgr.begin_step()  # the step that wrote the blocks is done: they are stored
        out += [b for b in [self.batch()] if b]
        if free:
            self.mgr.free(sid)
        return out


def feed(index: PodIndex, engine: Engine, batches: list[bytes]) -> None:
    for b in batches:
        index.receive(engine.seq, b, None)
        engine.seq += 1


def test_hashes_are_what_the_blockmgr_publishes_under_the_pods_seed() -> None:
    """The pods run with PYTHONHASHSEED=42 (deploy/k8s/pagedserve.yaml); the blockmgr reads it at
    import, so a fresh interpreter publishes; the picker computes the same from the tokens alone."""
    tokens = list(range(100, 137))  # 9 full blocks of 4, one token over
    child = (
        "import json, sys, msgspec\n"
        "from pagedserve.blockmgr.manager import BlockManager\n"
        f"m = BlockManager(num_gpu_blocks=12, num_cpu_blocks=0, block_size={BS}, kv_events=True)\n"
        "m.take_kv_events()\n"
        f"t = {tokens}\n"
        "m.begin_step(); m.allocate(1, t, len(t)); m.begin_step()\n"
        "print(json.dumps([e.block_hashes[0] for e in m.take_kv_events().events]))\n")
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONHASHSEED": "42"}, cwd="/")
    assert r.returncode == 0, r.stderr[-2000:]
    published = json.loads(r.stdout.splitlines()[-1])
    assert len(published) == 9
    assert block_hashes(tokens, BS, "42") == published
    assert block_hashes(tokens, BS, "vllm-none-hash") != published  # the seed matters: a wrong one never hits
    # and in this process, under its own seed
    engine = Engine(12)
    [batch] = engine.run(tokens)[1:]
    assert [e.block_hashes[0] for e in msgspec.msgpack.decode(batch, type=KVEventBatch).events] == \
        block_hashes(tokens, BS, SEED)
    assert NONE_HASH  # the module's own seed was read


def test_index_follows_stored_removed_and_cleared() -> None:
    engine, index = Engine(blocks=5), PodIndex()  # 4 usable blocks
    a = list(range(1, 11))  # two full blocks
    feed(index, engine, engine.run(a))
    assert index.snapshot() == set(block_hashes(a, BS, SEED))
    assert index.prefix(block_hashes(a + [11, 12], BS, SEED)) == 2
    b = list(range(20, 32))  # three full blocks: one of a's is evicted (4 usable)
    feed(index, engine, engine.run(b))
    held = set(block_hashes(b, BS, SEED)) | {block_hashes(a, BS, SEED)[0]}
    assert index.snapshot() == held, "a's second block was taken and its BlockRemoved applied"
    assert index.prefix(block_hashes(a, BS, SEED)) == 1
    engine.mgr.reset()
    feed(index, engine, [engine.batch()])  # type: ignore[list-item]
    assert index.snapshot() == set() and index.batches == 3 + 1


def test_gap_is_replayed_and_a_restarted_publisher_starts_over() -> None:
    engine, index = Engine(), PodIndex()
    a, b = list(range(1, 9)), list(range(40, 52))
    kept: list[tuple[int, bytes]] = []
    for payload in engine.run(a) + engine.run(b):
        kept.append((len(kept), payload))
    # only the last batch arrives live: the first ones come from the replay
    asked: list[int] = []

    def replay(first: int) -> list[tuple[int, bytes]]:
        asked.append(first)
        return [kv for kv in kept if kv[0] >= first]

    index.receive(kept[-1][0], kept[-1][1], replay)
    assert asked == [0] and index.next_seq == len(kept)
    assert index.snapshot() == set(block_hashes(a, BS, SEED)) | set(block_hashes(b, BS, SEED))
    fresh = Engine()  # the blockmgr restarted: seq 0 again, beginning with AllBlocksCleared
    c = list(range(70, 78))
    batches = fresh.run(c)
    index.receive(0, batches[0], replay)
    index.receive(1, batches[1], replay)
    assert index.restarts == 1 and index.snapshot() == set(block_hashes(c, BS, SEED))


def _two_pods(imbalance: int = 8, policy: str = "kv") -> tuple[Picker, list[list[int]]]:
    pods = [Pod("pod-a", "http://a"), Pod("pod-b", "http://b")]
    p1, p2 = list(range(1, 13)), list(range(200, 216))  # 3 and 4 full blocks
    for pod, prompt in zip(pods, (p1, p2)):
        engine = Engine(12)
        feed(pod.index, engine, engine.run(prompt))
    return Picker(pods, policy, imbalance), [p1, p2]


def test_kv_policy_picks_the_longest_cached_prefix_then_the_least_loaded() -> None:
    picker, (p1, p2) = _two_pods()
    a, b = picker.pods

    def pick(tokens: list[int]) -> tuple[str, str, int]:
        c = picker.choose(block_hashes(tokens, BS, SEED))
        return c.pod.name, c.reason, c.hit_blocks

    assert pick(p1 + [99] * 8) == ("pod-a", "prefix_hit", 3)
    assert pick(p2[:8] + [5] * 4) == ("pod-b", "prefix_hit", 2)
    # nobody holds it: the least loaded, the first in pod order on a tie
    assert pick([7] * 16) == ("pod-a", "least_loaded", 0)
    b.in_flight = 0
    a.in_flight = 1
    assert pick([8] * 16) == ("pod-b", "least_loaded", 0)
    # the longer prefix wins over load within the imbalance
    a.in_flight, b.in_flight = 8, 0
    assert pick(p1) == ("pod-a", "prefix_hit", 3)
    a.in_flight = 9  # past it: the least loaded, counted as a fallback
    assert pick(p1) == ("pod-b", "fallback", 0)
    a.in_flight = 0
    # a request just routed counts its blocks for its pod before the events come (and only for a while)
    fresh = list(range(500, 516))
    b.in_flight = 0
    assert pick(fresh) == ("pod-a", "least_loaded", 0)
    a.in_flight = 3
    assert pick(fresh + [1, 2, 3, 4]) == ("pod-a", "prefix_hit", 4)
    a.recent = {h: t - 10 for h, t in a.recent.items()}  # older than SPECULATIVE_TTL_S
    assert pick(fresh) == ("pod-b", "least_loaded", 0)
    assert a.routed == {"prefix_hit": 3, "least_loaded": 2} and b.routed == {"prefix_hit": 1, "least_loaded": 2,
                                                                             "fallback": 1}
    # a pod that refused the connection is left out for that request
    assert picker.choose(block_hashes(p1, BS, SEED), frozenset({"pod-a"})).pod is b


def test_round_robin_ignores_the_cache() -> None:
    picker, (p1, _) = _two_pods(policy="round-robin")
    got = [picker.choose(block_hashes(p1, BS, SEED)) for _ in range(4)]
    assert [(c.pod.name, c.reason) for c in got] == [("pod-a", "round_robin"), ("pod-b", "round_robin")] * 2
    assert [c.hit_blocks for c in got] == [3, 0, 3, 0]  # what the chosen pod happened to hold
    with pytest.raises(ValueError):
        Picker(picker.pods, "random")


def _free_tcp() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_reader_follows_a_real_publisher_over_tcp_with_replay() -> None:
    """The blockmgr's KVEventPublisher on tcp, batches published before the picker subscribed
    (kept for replay) and after: the index holds exactly the stored blocks."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pub_port, replay_port = _free_tcp(), _free_tcp()
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{pub_port}",
                         replay_endpoint=f"tcp://127.0.0.1:{replay_port}", topic="kv@pod-a@SmolLM2-135M-Instruct")
    publisher = KVEventPublisher(ctx, cfg)
    engine = Engine(12)
    a, b = list(range(1, 13)), list(range(300, 320))
    for payload in engine.run(a):
        publisher.publish(msgspec.msgpack.decode(payload, type=KVEventBatch))
    pod = Pod("pod-a", "http://unused", f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}")
    reader = EventReader([pod], ctx)
    try:
        want = set(block_hashes(a, BS, SEED)) | set(block_hashes(b, BS, SEED))
        deadline = time.monotonic() + 20
        batches = engine.run(b)
        while pod.index.snapshot() != want and time.monotonic() < deadline:
            for payload in batches:  # a SUB joins late: publish until it hears one, then the gap replays
                publisher.publish(msgspec.msgpack.decode(payload, type=KVEventBatch))
            for _ in range(10):
                publisher.serve_replay()
                time.sleep(0.02)
        assert pod.index.snapshot() == want
    finally:
        reader.close()
        publisher.close()
        ctx.term()


def test_kube_benchmark_reads_each_pods_counters_and_judges_from_the_medians() -> None:
    """benchmarks/kube_multiturn.py: a pod's own /metrics (no replica label) and Ray's ingress's
    (one per replica label) give the hit and query counts; the verdicts follow the figures."""
    from benchmarks.kube_multiturn import verdicts
    from benchmarks.multiturn_client import median_row, prefix_counters

    pod = ('# TYPE vllm:prefix_cache_hits_total counter\n'
           'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 96.0\n'
           'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 128.0\n'
           'vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9\n')
    assert prefix_counters(pod) == {"": (96.0, 128.0)}
    ray = pod.replace('engine="0"', 'replica="r1"') + pod.replace('engine="0"', 'replica="r2"').replace("96.0", "4.0")
    assert prefix_counters(ray, "replica") == {"r1": (96.0, 128.0), "r2": (4.0, 128.0)}
    run = {"prefix_hit_rate": 0.7, "ttft_p50_s": 1.0, "ttft_p99_s": 9.0, "output_tok_s": 30.0, "lost": []}
    slow = run | {"prefix_hit_rate": 0.3, "ttft_p50_s": 4.0, "ttft_p99_s": 8.0, "output_tok_s": 15.0}
    table = {"kv": median_row([run, run | {"ttft_p50_s": 3.0}, run]), "round-robin": median_row([slow] * 3)}
    assert table["kv"]["ttft_p50_s"] == 1.0
    assert verdicts(table) == {"hit_rate_ahead": True, "ttft_p50_ahead": True, "ttft_p99_ahead": False,
                               "throughput_ahead": True, "nothing_lost": True}
    table["round-robin"]["lost"] = 1
    assert not verdicts(table)["nothing_lost"]
