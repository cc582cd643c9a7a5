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

``RoundRobinRouter``: the baseline, replicas in turn.

Both leave out a replica whose engine is down (its stats say so) or whose
stats stopped changing for ``STALE_PERIODS`` stats periods (its actor died or
hangs), unless no replica is left; Serve itself drops a replica at once when a
call to it finds its actor dead. Both count their choices in observe.py's
families (by reason, and the chosen replica's prefix hit in blocks)."""
from __future__ import annotations

import itertools
import time
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedserve.rayserve import observe

SPECULATIVE_TTL_S = 5.0
# A replica whose stats have not changed for this long is left out (they change every period: a timestamp)
STALE_PERIODS, STALE_MIN_S = 4, 3.0
DEFAULT_PERIOD_S = 0.5


def _hashes(pending: PendingRequest | None) -> list[int]:
    if pending is None or not pending.args or not isinstance(pending.args[0], dict):
        return []
    return list(pending.args[0].get("block_hashes", ()))


class _Observed(FIFOMixin, RequestRouter):
    """Health filtering and the routing metrics both routers share."""

    def _setup(self, stats_period_s: float) -> None:
        self._period = stats_period_s
        self._ages = observe.StatsAge()
        # request id -> (reason, hit, the first rank's replicas), until Serve routes it
        self._decided: dict[str, tuple[str, int | None, set[ReplicaID]]] = {}
        self._sets: dict[ReplicaID, tuple[list[int], set[int]]] = {}  # replica -> (its stats list, as a set)
        observe.register(self)

    def usable(self, r: RunningReplica) -> bool:
        stats = r.routing_stats or {}
        if not stats:  # no report yet: a replica just started (Serve lists it once it is ready)
            return True
        return bool(stats.get("healthy", True)) and \
            self._ages.age(r.replica_id, stats.get("at")) <= max(STALE_PERIODS * self._period, STALE_MIN_S)

    def _healthy(self, candidates: list[RunningReplica]) -> list[RunningReplica]:
        ok = [r for r in candidates if self.usable(r)]
        for r in candidates:
            if r not in ok:
                observe.UNROUTABLE.labels(r.replica_id.unique_id).inc()
        return ok or candidates

    def _cached(self, r: RunningReplica) -> set[int]:
        """The replica's reported blocks as a set, made once per report."""
        blocks = (r.routing_stats or {}).get("cached_blocks", [])
        got = self._sets.get(r.replica_id)
        if got is None or got[0] is not blocks:  # a new report (the list held, so its id is never reused)
            got = (blocks, set(blocks))
            self._sets[r.replica_id] = got
            self._new_report(r.replica_id)
        return got[1]

    def _new_report(self, replica_id: ReplicaID) -> None:
        pass

    def hit(self, r: RunningReplica, hashes: list[int]) -> int:
        """Leading blocks of the prompt this replica reported holding."""
        cached = self._cached(r)
        n = 0
        for h in hashes:
            if h not in cached:
                break
            n += 1
        return n

    def _decide(self, pending: PendingRequest | None, reason: str, first: list[RunningReplica],
                hit: int | None = None) -> None:
        """Remembers why, until Serve says where it went (it picks within the first rank, or takes the next)."""
        if pending is not None:
            self._decided[pending.metadata.internal_request_id] = (reason, hit, {r.replica_id for r in first})

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        reason, hit, first = self._decided.pop(pending_request.metadata.internal_request_id, ("", None, set()))
        if not reason:
            return
        if replica_id not in first:  # the first rank was full: Serve took the next
            reason, hit = ("fallback" if reason == "prefix_hit" else reason), None
        if hit is None:
            r = self.curr_replicas.get(replica_id)
            hit = self.hit(r, _hashes(pending_request)) if r is not None else 0
        observe.ROUTED.labels(reason).inc()
        observe.HIT_BLOCKS.observe(hit)
        hs = _hashes(pending_request)
        observe.trace({"ev": "routed", "h0": hs[0] if hs else None, "n": len(hs), "replica": replica_id.unique_id,
                       "reason": reason, "hit": hit})

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._ages.forget(replica_id)
        self._sets.pop(replica_id, None)


class KVAffinityRouter(_Observed):
    def initialize_state(self, imbalance: int = 8, stats_period_s: float = DEFAULT_PERIOD_S, **kwargs: Any) -> None:
        self._setup(stats_period_s)
        self.imbalance = imbalance
        self._recent: dict[ReplicaID, dict[int, float]] = {}  # replica -> hash -> routed at
        self._routed: dict[ReplicaID, int] = {}  # requests routed here since its last stats report

    def _new_report(self, replica_id: ReplicaID) -> None:
        self._routed[replica_id] = 0  # the report counts them now

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
        candidates = self._healthy(candidate_replicas)
        by_load = sorted(candidates, key=self._load)
        hashes = _hashes(pending_request)
        reason = "least_loaded"
        if hashes:
            best = max(candidates, key=lambda r: (self.match(r, hashes), -self._load(r)))
            got = self.match(best, hashes)
            if got > 0 and self._load(best) <= self._load(by_load[0]) + self.imbalance:
                self._remember(best.replica_id, hashes)
                self._decide(pending_request, "prefix_hit", [best], got)
                self._trace_view(candidates, hashes, [best])
                return [[best], [r for r in by_load if r is not best]]
            reason = "fallback" if got > 0 else reason
        least = self._load(by_load[0])
        first = [r for r in by_load if self._load(r) == least]
        self._decide(pending_request, reason, first)
        self._trace_view(candidates, hashes, first)
        return [first, by_load]

    def _trace_view(self, candidates: list[RunningReplica], hashes: list[int], first: list[RunningReplica]) -> None:
        observe.trace({"ev": "choose", "h0": hashes[0] if hashes else None, "n": len(hashes),
                       "first": [r.replica_id.unique_id for r in first],
                       "view": {r.replica_id.unique_id: [self._load(r), (r.routing_stats or {}).get("in_flight"),
                                                         self._routed.get(r.replica_id, 0), self.match(r, hashes)]
                                for r in candidates}})

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
        super().on_request_routed(pending_request, replica_id, result)
        hashes = _hashes(pending_request)
        if hashes:
            self._remember(replica_id, hashes)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._recent.pop(replica_id, None)
        self._routed.pop(replica_id, None)


class RoundRobinRouter(_Observed):
    def initialize_state(self, stats_period_s: float = DEFAULT_PERIOD_S, **kwargs: Any) -> None:
        self._setup(stats_period_s)
        self._turn = itertools.count()

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        ordered = sorted(self._healthy(candidate_replicas), key=lambda r: r.replica_id.unique_id)
        first = next(self._turn) % len(ordered)
        pick = ordered[first]
        self._decide(pending_request, "round_robin", [pick])
        return [[pick], ordered[first + 1:] + ordered[:first]]
