"""A small endpoint picker for engine pods (issue 42, the Kubernetes path without a cluster):
what llm-d's EPP does with its precise prefix-cache scorer, for `podman kube play`, which has
no Gateway API to run llm-d's picker in (docs/deployment.md).

Each pod's blockmgr publishes vLLM's KV events (docs/blockmgr.md: PUB frames ``(topic, seq,
msgpack batch)``, a ROUTER socket replaying the last batches). ``PodIndex`` keeps one pod's
cached block hashes from them (BlockStored, BlockRemoved, AllBlocksCleared; the GPU medium
only); a gap in the sequence is filled from the replay socket, and a sequence that starts over
(a restarted blockmgr) starts the index over. ``Picker`` hashes a request's prompt as the
blockmgr does (vLLM's sha256_cbor chained from the seed, common/block_hash.py) and picks the
pod holding the longest cached prefix; ties and prompts nobody holds go to the pod with the
fewest requests in flight through the picker, and so does a hit on a pod that has ``imbalance``
more in flight than the least loaded one (reason ``fallback``). A request just routed counts
its blocks for its pod at once for ``SPECULATIVE_TTL_S`` (the events come a step later; llm-d
calls it speculative indexing). ``--policy round-robin`` is the baseline.

The events are decoded with structs of our own written from vLLM's format, so the picker
reads any vLLM-format publisher, and imports nothing of a component (common/ only)."""
from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from pagedserve.common.block_hash import external_hash, none_hash, sha256_cbor_block

SPECULATIVE_TTL_S = 5.0
MAX_RECENT = 100_000  # speculative hashes kept per pod
END_SEQ = -1  # the replay socket's end marker


class _Event(msgspec.Struct, tag=True, omit_defaults=True):  # type: ignore[call-arg]
    """vLLM's KVCacheEvent: a map tagged with its class name under "type"."""


class BlockStored(_Event):
    block_hashes: list[int]
    parent_block_hash: int | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class BlockRemoved(_Event):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(_Event):
    pass


class Batch(msgspec.Struct, array_like=True):  # type: ignore[call-arg]
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_decode_batch = msgspec.msgpack.Decoder(Batch).decode


def block_hashes(token_ids: list[int], block_size: int, seed: str) -> list[int]:
    """The (int) hashes the blockmgr publishes for these tokens' full blocks, under ``seed``
    (the pods' PYTHONHASHSEED; vLLM's default seed is "vllm-none-hash")."""
    out: list[int] = []
    h = none_hash(seed)
    for i in range(len(token_ids) // block_size):
        h = sha256_cbor_block(h, token_ids[i * block_size:(i + 1) * block_size])
        out.append(external_hash(h))
    return out


class PodIndex:
    """One pod's cached blocks, from its event stream (thread-safe)."""

    def __init__(self) -> None:
        self.hashes: set[int] = set()
        self.next_seq = 0
        self.batches = 0
        self.restarts = 0
        self._lock = threading.Lock()

    def apply(self, payload: bytes) -> None:
        batch = _decode_batch(payload)
        with self._lock:
            for e in batch.events:
                if isinstance(e, AllBlocksCleared):
                    self.hashes.clear()
                elif e.medium not in (None, "GPU"):  # the swap pool's copies do not save a prefill
                    continue
                elif isinstance(e, BlockStored):
                    self.hashes.update(e.block_hashes)
                else:
                    self.hashes.difference_update(e.block_hashes)
            self.batches += 1

    def receive(self, seq: int, payload: bytes, replay: Callable[[int], list[tuple[int, bytes]]] | None) -> None:
        """A live batch. ``replay(first)`` returns the kept batches from ``first`` on (the pod's
        replay socket); without it a gap is skipped (the index may then hold stale blocks)."""
        if seq < self.next_seq:  # the sequence started over: a new blockmgr (its batch 0 clears)
            with self._lock:
                self.hashes.clear()
            self.next_seq = 0
            self.restarts += 1
        if seq > self.next_seq and replay is not None:
            for s, p in replay(self.next_seq):
                if self.next_seq <= s < seq:
                    self.apply(p)
                    self.next_seq = s + 1
        self.apply(payload)
        self.next_seq = seq + 1

    def snapshot(self) -> set[int]:
        with self._lock:
            return set(self.hashes)

    def prefix(self, hashes: list[int]) -> int:
        """Leading blocks of ``hashes`` this pod caches."""
        n = 0
        with self._lock:
            for h in hashes:
                if h not in self.hashes:
                    break
                n += 1
        return n


@dataclass
class Pod:
    name: str
    http: str  # its OpenAI server, http://HOST:8000
    events: str | None = None  # its KV event PUB socket, tcp://HOST:5560
    replay: str | None = None  # its replay ROUTER socket, tcp://HOST:5561
    index: PodIndex = field(default_factory=PodIndex)
    in_flight: int = 0
    routed: dict[str, int] = field(default_factory=dict)  # reason -> requests
    recent: dict[int, float] = field(default_factory=dict)  # hash -> when a request with it was routed here

    def match(self, hashes: list[int], now: float) -> int:
        """Leading blocks cached here, or sent here in the last SPECULATIVE_TTL_S."""
        n = self.index.prefix(hashes)
        for h in hashes[n:]:
            t = self.recent.get(h)
            if t is None or now - t > SPECULATIVE_TTL_S:
                break
            n += 1
        return n

    def remember(self, hashes: list[int], now: float) -> None:
        for h in hashes:
            self.recent[h] = now
        if len(self.recent) > MAX_RECENT:  # drop the oldest half
            for h, _ in sorted(self.recent.items(), key=lambda kv: kv[1])[: len(self.recent) // 2]:
                del self.recent[h]


@dataclass(frozen=True)
class Choice:
    pod: Pod
    reason: str  # prefix_hit, least_loaded, fallback, round_robin
    hit_blocks: int


class Picker:
    def __init__(self, pods: list[Pod], policy: str = "kv", imbalance: int = 8) -> None:
        if not pods:
            raise ValueError("no pods to pick from")
        if policy not in ("kv", "round-robin"):
            raise ValueError(f"policy: kv or round-robin, not {policy!r}")
        self.pods, self.policy, self.imbalance = pods, policy, imbalance
        self._turn = itertools.count()
        self.hit_blocks_total = 0

    def choose(self, hashes: list[int], exclude: frozenset[str] = frozenset()) -> Choice:
        """The pod for a prompt with these block hashes (``exclude``: pods that refused it)."""
        pods = [p for p in self.pods if p.name not in exclude] or self.pods
        now = time.monotonic()
        if self.policy == "round-robin":
            pod = pods[next(self._turn) % len(pods)]
            choice = Choice(pod, "round_robin", pod.match(hashes, now))
        else:
            least = min(pods, key=lambda p: p.in_flight)  # first of the least loaded, in pod order
            best = max(pods, key=lambda p: (p.match(hashes, now), -p.in_flight)) if hashes else least
            got = best.match(hashes, now) if hashes else 0
            if got > 0 and best.in_flight <= least.in_flight + self.imbalance:
                choice = Choice(best, "prefix_hit", got)
            else:
                choice = Choice(least, "fallback" if got > 0 else "least_loaded", least.match(hashes, now))
            choice.pod.remember(hashes, now)
        choice.pod.routed[choice.reason] = choice.pod.routed.get(choice.reason, 0) + 1
        self.hit_blocks_total += choice.hit_blocks
        return choice

    def state(self) -> dict[str, Any]:
        return {"policy": self.policy, "hit_blocks_total": self.hit_blocks_total,
                "pods": [{"name": p.name, "http": p.http, "events": p.events, "cached_blocks": len(p.index.hashes),
                          "event_batches": p.index.batches, "next_seq": p.index.next_seq,
                          "publisher_restarts": p.index.restarts, "in_flight": p.in_flight, "routed": p.routed}
                         for p in self.pods]}


class EventReader:
    """Reads each pod's KV events into its index, on one thread (plain ZeroMQ, as vLLM and the
    blockmgr publish them: the events carry token ids, so only the picker should reach them)."""

    def __init__(self, pods: list[Pod], ctx: zmq.Context[zmq.Socket[bytes]] | None = None) -> None:
        self._ctx = ctx or zmq.Context.instance()
        self._subs: dict[zmq.Socket[bytes], Pod] = {}
        for pod in pods:
            if pod.events is None:
                continue
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.LINGER, 0)
            sub.connect(pod.events)
            self._subs[sub] = pod
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-events")
        self._thread.start()

    def _replayer(self, pod: Pod) -> Callable[[int], list[tuple[int, bytes]]] | None:
        if pod.replay is None:
            return None

        def replay(first: int) -> list[tuple[int, bytes]]:
            sock = self._ctx.socket(zmq.DEALER)  # a REQ socket would take only the first reply
            sock.setsockopt(zmq.RCVTIMEO, 5000)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(pod.replay)  # type: ignore[arg-type]
            out: list[tuple[int, bytes]] = []
            try:
                sock.send_multipart((b"", first.to_bytes(8, "big")))
                while True:
                    frames = sock.recv_multipart()
                    seq = int.from_bytes(frames[-2], "big", signed=True)
                    if seq == END_SEQ:
                        return out
                    out.append((seq, frames[-1]))
            except zmq.Again:  # the pod went away meanwhile: what came is applied
                return out
            finally:
                sock.close(0)
        return replay

    def _run(self) -> None:
        poller = zmq.Poller()
        for sub in self._subs:
            poller.register(sub, zmq.POLLIN)
        while not self._stop.is_set():
            for sub, _ in poller.poll(100):
                frames = sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    continue
                pod = self._subs[sub]
                try:
                    pod.index.receive(int.from_bytes(frames[1], "big"), frames[2], self._replayer(pod))
                except (msgspec.DecodeError, msgspec.ValidationError):
                    pass  # not a vLLM-format batch: nothing to learn from it

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        for sub in self._subs:
            sub.close(0)
