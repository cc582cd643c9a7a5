"""Ray Serve request routers (``RequestRouterConfig.request_router_class``).

``KVAffinityRouter`` sends a request to the replica holding the longest
cached prefix of its prompt: the ingress puts the prompt's block hashes in
the request (vLLM's sha256_cbor, common/block_hash.py), and each replica
reports the hashes its engine caches (from its KV events) as routing
stats. Stats lag by up to a stats period, so the blocks of a request just
routed are counted for its replica at once (what llm-d calls speculative
indexing) until the next report. A replica whose load exceeds the least
loaded one's by more than ``imbalance`` loses its affinity: the request goes
to the least loaded (Ray then probes queue lengths among them).

``RoundRobinRouter``: the baseline, replicas in turn."""
from __future__ import annotations

import itertools
import time
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

SPECULATIVE_TTL_S = 5.0


def _hashes(pending: PendingRequest | None) -> list[int]:
    if pending is None or not pending.args or not isinstance(pending.args[0], dict):
        return []
    return list(pending.args[0].get("block_hashes", ()))


class KVAffinityRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, imbalance: int = 8, **kwargs: Any) -> None:
        self.imbalance = imbalance
        self._sets: dict[ReplicaID, tuple[list[int], set[int]]] = {}  # replica -> (its stats list, as a set)
        self._recent: dict[ReplicaID, dict[int, float]] = {}  # replica -> hash -> routed at
        self._routed: dict[ReplicaID, int] = {}  # requests routed here since its last stats report

    def _cached(self, r: RunningReplica) -> set[int]:
        stats = r.routing_stats or {}
        blocks = stats.get("cached_blocks", [])
        got = self._sets.get(r.replica_id)
        if got is None or got[0] is not blocks:  # a new report (the list held, so its id is never reused)
            got = (blocks, set(blocks))
            self._sets[r.replica_id] = got
            self._routed[r.replica_id] = 0
        return got[1]

    def _load(self, r: RunningReplica) -> int:
        stats = r.routing_stats or {}
        return int(stats.get("in_flight", 0)) + self._routed.get(r.replica_id, 0)

    def match(self, r: RunningReplica, hashes: list[int]) -> int:
        """Leading blocks of the prompt this replica holds (or was just sent)."""
        cached = self._cached(r)
        recent = self._recent.get(r.replica_id, {})
        now = time.monotonic()
        n = 0
        for h in hashes:
            t = recent.get(h)
            if h not in cached and (t is None or now - t > SPECULATIVE_TTL_S):
                break
            n += 1
        return n

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_load = sorted(candidate_replicas, key=self._load)
        hashes = _hashes(pending_request)
        if hashes:
            best = max(candidate_replicas, key=lambda r: (self.match(r, hashes), -self._load(r)))
            if self.match(best, hashes) > 0 and self._load(best) <= self._load(by_load[0]) + self.imbalance:
                self._remember(best.replica_id, hashes)
                return [[best], [r for r in by_load if r is not best]]
        least = self._load(by_load[0])
        return [[r for r in by_load if self._load(r) == least], by_load]

    def _remember(self, replica_id: ReplicaID, hashes: list[int]) -> None:
        recent = self._recent.setdefault(replica_id, {})
        now = time.monotonic()
        for h in hashes:
            recent[h] = now
        if len(recent) > 100_000:  # forget the oldest half
            for h, _ in sorted(recent.items(), key=lambda kv: kv[1])[: len(recent) // 2]:
                del recent[h]

    def on_send_request(self, replica_id: ReplicaID) -> None:
        super().on_send_request(replica_id)
        self._routed[replica_id] = self._routed.get(replica_id, 0) + 1

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        hashes = _hashes(pending_request)
        if hashes:
            self._remember(replica_id, hashes)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._sets.pop(replica_id, None)
        self._recent.pop(replica_id, None)
        self._routed.pop(replica_id, None)


class RoundRobinRouter(FIFOMixin, RequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        self._turn = itertools.count()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        first = next(self._turn) % len(ordered)
        return [[ordered[first]], ordered[first + 1:] + ordered[:first]]
