"""Ray Serve request routers (``RequestRouterConfig.request_router_class``).

``KVAffinityRouter`` sends a request where it expects the first token
soonest: the replica holding the longest cached prefix of its prompt, unless
that replica is busier than recomputing the prompt elsewhere would cost
(affinity.py, which also counts each replica's load: the requests this router
sent there, from its choice until Serve reports the response ended). The
ingress puts the prompt's block hashes in the request (vLLM's sha256_cbor,
common/block_hash.py), and each replica reports the hashes its engine caches
(from its KV events) as routing stats. Stats lag by up to a stats period, so
the blocks of a request just routed count as cached on its replica at once
(what llm-d calls speculative indexing). Each choice is a single replica,
then the others in order of cost: Serve takes the next only when one is full.

``RoundRobinRouter``: the baseline, replicas in turn.

Neither uses Serve's FIFOMixin: with it, the replica chosen for one request
went to whichever request was first in the queue when the choice completed
(the choices of a burst run concurrently, each waiting on a queue-length
probe), so a prompt's prefix hit could be handed to another user's prompt.
Both leave out a replica whose engine is down (its stats say so) or whose
stats stopped changing for ``STALE_PERIODS`` stats periods (its actor died or
hangs), unless no replica is left; Serve itself drops a replica at once when a
call to it finds its actor dead. Both count their choices in observe.py's
families (by reason, and the chosen replica's prefix hit in blocks), and with
``trace`` (build_app) set they write each choice there (observe.trace)."""
from __future__ import annotations

import itertools
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from pagedserve.rayserve import observe
from pagedserve.rayserve.affinity import DECODE_BLOCKS, IMBALANCE, SPECULATIVE_TTL_S, Affinity

__all__ = ["KVAffinityRouter", "RoundRobinRouter", "SPECULATIVE_TTL_S"]
# A replica whose stats have not changed for this long is left out (they change every period: a timestamp)
STALE_PERIODS, STALE_MIN_S = 4, 3.0
DEFAULT_PERIOD_S = 0.5


def _hashes(pending: PendingRequest | None) -> list[int]:
    if pending is None or not pending.args or not isinstance(pending.args[0], dict):
        return []
    return list(pending.args[0].get("block_hashes", ()))


class _Observed(RequestRouter):
    """Health filtering and the routing metrics both routers share."""

    def _setup(self, stats_period_s: float, trace: str | None) -> None:
        self._period, self._trace = stats_period_s, trace
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
        return got[1]

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
        observe.trace(self._trace, {"ev": "routed", "key": pending_request.metadata.internal_request_id,
                       "h0": hs[0] if hs else None, "n": len(hs), "replica": replica_id.unique_id,
                       "reason": reason, "hit": hit})

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._ages.forget(replica_id)
        self._sets.pop(replica_id, None)


class KVAffinityRouter(_Observed):
    def initialize_state(self, imbalance: int = IMBALANCE, stats_period_s: float = DEFAULT_PERIOD_S,
                         decode_blocks: int = DECODE_BLOCKS, trace: str | None = None, **kwargs: Any) -> None:
        self._setup(stats_period_s, trace)
        self.imbalance = imbalance
        self.affinity = Affinity(imbalance, decode_blocks)

    def _load(self, r: RunningReplica) -> int:
        """Requests in flight on the replica that this router sent (until their responses ended)."""
        return self.affinity.load(r.replica_id.unique_id)[1]

    def match(self, r: RunningReplica, hashes: list[int]) -> int:
        """Leading blocks of the prompt this replica holds (or was just sent)."""
        return self.affinity.hit(r.replica_id.unique_id, self._cached(r), hashes)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in self._healthy(candidate_replicas)}
        hashes = _hashes(pending_request)
        key = pending_request.metadata.internal_request_id if pending_request is not None else None
        choice = self.affinity.choose([(rid, self._cached(r)) for rid, r in by_id.items()], hashes, key)
        ranked = [by_id[rid] for rid in choice.ranked]
        self._decide(pending_request, choice.reason, ranked[:1], choice.hit)
        observe.trace(self._trace, {"ev": "choose", "key": key, "h0": hashes[0] if hashes else None, "n": len(hashes),
                       "reason": choice.reason, "hit": choice.hit, "ranked": choice.ranked, "costs": choice.costs,
                       "requests": {rid: self.affinity.load(rid)[1] for rid in choice.ranked}})
        return [[r] for r in ranked]  # in order: Serve tries the next only when one is full

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        super().on_request_routed(pending_request, replica_id, result)
        r = self.curr_replicas.get(replica_id)
        self.affinity.routed(pending_request.metadata.internal_request_id, replica_id.unique_id,
                             _hashes(pending_request), self._cached(r) if r is not None else set())

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        f = self.affinity.flights.get(internal_request_id)
        if f is not None and f.replica == replica_id.unique_id:  # not a rejected try Serve has since re-routed
            self.affinity.finished(internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.affinity.forget(replica_id.unique_id)


class RoundRobinRouter(_Observed):
    def initialize_state(self, stats_period_s: float = DEFAULT_PERIOD_S, trace: str | None = None,
                         **kwargs: Any) -> None:
        self._setup(stats_period_s, trace)
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
